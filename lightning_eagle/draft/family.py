"""Draft families as plug-ins: what the draft layer knows of a family, registered next to the family's code.

A family is data plus one record per layer. This layer's record, :class:`DraftFamily`, says what a checkpoint and an
export say about the family: how its exports are recognised and loaded, how a draft (a trained module or a training
checkpoint) is exported and served, and which target layers it taps. Its other layers register their own records
by the family's name (the LightningModule: :class:`~lightning_eagle.training.draft_training.DraftTrainingModule`'s
``family``; decoding: :mod:`lightning_eagle.inference.decoding_family`; the memory plan:
:mod:`lightning_eagle.planning.family`), in the modules the record lists in ``layers`` by layer name (a module is
imported when its layer first looks the family up: the one sanctioned upward reference, by name, of a plug-in).

Shared code looks a family up — by name (a checkpoint's :data:`~lightning_eagle.checkpoint_keys.DRAFT_FAMILY`), by a
draft object, by an export's ``config.json`` — and never names one. A new family registers its record with
:func:`register_draft_family`; nothing else in the library changes. A family outside this package is found by the
commands when its module is imported: named in the environment variable :data:`FAMILY_MODULES_ENV`
(``LIGHTNING_EAGLE_FAMILIES=my_pkg.my_family``, comma-separated) or declared by an installed package under the
entry-point group :data:`FAMILY_ENTRY_POINTS` (``[project.entry-points."lightning_eagle.families"]``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_eagle import checkpoint_keys as keys


@dataclass(frozen=True)
class DraftFamily:
    """One draft family as the draft layer knows it.

    ``name``: what checkpoints and registries call it. ``config_type``: its draft config (``from_dict`` /
    ``to_dict``). ``is_draft(obj)``: a built draft of this family. ``recognizes(config_json)``: an export's
    ``config.json`` is this family's. ``load_export(folder, target, dtype, device)``: the draft of an export, ready
    to decode against ``target``. ``export(source, out_dir, *, dtype, overwrite, include_embeddings)``: ``source`` (a
    draft, a module holding one as ``.draft``, or a training checkpoint dict) written in the serving layout,
    atomically; returns the folder. ``serve_lines(config_json, folder)``: how to serve that export.
    ``aux_layer_ids(config)``: the 0-based target layers the draft reads (its taps). ``legacy_config_keys``: where
    checkpoints written before the shared :data:`~lightning_eagle.checkpoint_keys.DRAFT_CONFIG` key held this
    family's config. ``layers``: layer name (``"training"``, ``"decoding"``, ``"planning"``) → the module that
    registers the family's record there. ``default``: the family of a run config that names
    no ``model.class_path`` (one family is). ``resumable_fields``: config fields a resume may see differ (set by the
    data or the training settings, or held by checkpoints of an older layout), never an architecture change.
    """

    name: str
    config_type: type
    is_draft: Callable[[Any], bool]
    recognizes: Callable[[dict[str, Any]], bool]
    load_export: Callable[[Path, Any, torch.dtype, str], Any]
    export: Callable[..., Path]
    serve_lines: Callable[[dict[str, Any], str], list[str]]
    aux_layer_ids: Callable[[Any], list[int] | None]
    legacy_config_keys: tuple[str, ...] = ()
    layers: Mapping[str, str] = field(default_factory=dict)
    default: bool = False
    resumable_fields: tuple[str, ...] = ()


DRAFT_FAMILIES: dict[str, DraftFamily] = {}
FAMILY_MODULES_ENV = "LIGHTNING_EAGLE_FAMILIES"
FAMILY_ENTRY_POINTS = "lightning_eagle.families"


def register_draft_family(family: DraftFamily) -> DraftFamily:
    """Add ``family`` (its name must be new)."""
    if family.name in DRAFT_FAMILIES:
        raise ValueError(f"draft family {family.name!r} is already registered")
    if family.default and any(f.default for f in DRAFT_FAMILIES.values()):
        raise ValueError(f"draft family {family.name!r}: another family is already the default")
    DRAFT_FAMILIES[family.name] = family
    return family


def unregister_draft_family(name: str) -> None:
    """Remove a family (a test's own family, after the test)."""
    DRAFT_FAMILIES.pop(name, None)


def load_family_layers(family: DraftFamily, layer: str | None = None) -> DraftFamily:
    """Import the module that registers ``family``'s record in ``layer`` (None: every layer); returns ``family``."""
    for name, module in family.layers.items():
        if layer is None or name == layer:
            importlib.import_module(module)
    return family


def default_family() -> DraftFamily:
    """The family a run config that names no ``model.class_path`` trains (its upper layers loaded)."""
    defaults = [f for f in DRAFT_FAMILIES.values() if f.default]
    if len(defaults) != 1:
        raise ValueError(
            f"{len(defaults)} registered draft families are the default (one must be: the family of a run config that "
            f"names no model.class_path); registered: {', '.join(sorted(DRAFT_FAMILIES))}"
        )
    return defaults[0]


def load_plugin_families() -> None:
    """Import the family modules of :data:`FAMILY_MODULES_ENV` and of installed packages' :data:`FAMILY_ENTRY_POINTS`
    (each registers its records when imported); a module that does not import is a ``ValueError`` naming it."""
    names = [n.strip() for n in os.environ.get(FAMILY_MODULES_ENV, "").split(",") if n.strip()]
    names += [entry.value for entry in importlib.metadata.entry_points(group=FAMILY_ENTRY_POINTS)]
    for name in names:
        try:
            importlib.import_module(name.split(":")[0])
        except ImportError as err:  # the user's setting names it: one error line, not a traceback
            raise ValueError(f"draft family module {name!r} (from {FAMILY_MODULES_ENV} or the "
                             f"{FAMILY_ENTRY_POINTS!r} entry points) does not import: {err}") from err  # fmt: skip


def load_all_families() -> dict[str, DraftFamily]:
    """Every family (the built-in ones and :func:`load_plugin_families`'s) with its upper layers loaded (a run
    config may name a family's module by its class name alone)."""
    load_plugin_families()
    for family in list(DRAFT_FAMILIES.values()):
        load_family_layers(family)
    return DRAFT_FAMILIES


def draft_family_named(name: object, source: str = "the checkpoint") -> DraftFamily:
    """The family registered as ``name`` (its upper layers loaded); an unknown one is a ``ValueError`` naming it."""
    if name not in DRAFT_FAMILIES:
        load_plugin_families()
    if name not in DRAFT_FAMILIES:
        raise ValueError(
            f"{source}: draft family {name!r} is not registered (known: {', '.join(sorted(DRAFT_FAMILIES))}); name "
            f"the module that registers it in {FAMILY_MODULES_ENV} or install the package that declares it"
        )
    return DRAFT_FAMILIES[name]


def draft_family_of(draft: Any) -> DraftFamily | None:
    """The family of a built draft; None when no family claims it (several claiming one is a ``ValueError``)."""
    matches = [f for f in DRAFT_FAMILIES.values() if f.is_draft(draft)]
    if len(matches) > 1:
        raise ValueError(f"{type(draft).__name__} is claimed by several draft families: {[f.name for f in matches]}")
    return matches[0] if matches else None


def export_config(folder: str | Path) -> dict[str, Any]:
    """The export's ``config.json`` (one ``ValueError`` naming the file when it is missing or not a JSON object)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"draft export {str(folder)!r} has no config.json (expected {path})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def export_family(config_json: dict[str, Any], source: str = "config.json") -> DraftFamily:
    """The one registered family that recognises an export's ``config_json``; none or several is a ``ValueError``."""
    matches = [f for f in DRAFT_FAMILIES.values() if f.recognizes(config_json)]
    if not matches:
        load_plugin_families()
        matches = [f for f in DRAFT_FAMILIES.values() if f.recognizes(config_json)]
    if len(matches) != 1:
        found = "no draft family" if not matches else "several draft families (" + ", ".join(f.name for f in matches)
        raise ValueError(
            f"{source}: {found}{')' if matches else ''} recognise architectures={config_json.get('architectures')!r}; "
            f"known families: {', '.join(sorted(DRAFT_FAMILIES))}"
        )
    return matches[0]


def load_export(folder: str | Path, target, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """``(family, draft)`` of the export at ``folder``, its family read from its ``config.json``."""
    if not Path(folder).is_dir():
        raise ValueError(f"draft folder {str(folder)!r} does not exist")
    family = export_family(export_config(folder), str(Path(folder) / "config.json"))
    return family, family.load_export(Path(folder), target, dtype, device)


def checkpoint_family(
    checkpoint: dict[str, Any], source: str = "the checkpoint", required: bool = True
) -> DraftFamily | None:
    """The family of a training checkpoint (``torch.load``'s dict), whose keys are brought to the shared layout in
    place first (:func:`~lightning_eagle.checkpoint_keys.renamed`, each family's ``legacy_config_keys``). A
    checkpoint that names no family is a ``ValueError`` (None when not ``required``)."""
    keys.renamed(checkpoint)
    if keys.DRAFT_FAMILY not in checkpoint:
        for family in DRAFT_FAMILIES.values():
            old = next((k for k in family.legacy_config_keys if k in checkpoint), None)
            if old is not None:
                checkpoint[keys.DRAFT_CONFIG] = checkpoint.pop(old)
                checkpoint[keys.DRAFT_FAMILY] = family.name
                break
    if keys.DRAFT_FAMILY not in checkpoint:
        if not required:
            return None
        raise ValueError(
            f"{source} names no draft family (no {keys.DRAFT_FAMILY!r} entry): not a checkpoint written by "
            "lightning-eagle fit"
        )
    return draft_family_named(checkpoint[keys.DRAFT_FAMILY], source)


class LayerRecords(dict):
    """One layer's records of the draft families, by family name (the decoding loops, the memory plan, the training
    modules): each family registers its own next to its code; a lookup imports the family's modules first."""

    def __init__(self, layer: str, what: str) -> None:
        super().__init__()
        self.layer = layer  # the key of DraftFamily.layers naming the module that registers a family's record here
        self.what = what  # what a record of this layer is, for the messages ("decoding loop")

    def register(self, name: str, record):
        """Add ``record`` under the family ``name`` (which must be new to this layer); returns it."""
        if name in self:
            raise ValueError(f"draft family {name!r} already registers a {self.what}")
        self[name] = record
        return record

    def named(self, name: str, source: str):
        """The record of the family ``name`` (the family's modules imported first); one it lacks is a
        ``ValueError`` naming the family and the ones that have one."""
        load_family_layers(draft_family_named(name, source), self.layer)
        if name not in self:
            raise ValueError(f"{source}: draft family {name!r} registers no {self.what} (families with one: "
                             f"{', '.join(sorted(self))})")  # fmt: skip
        return self[name]


def checkpoint_draft_state(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The draft's tensors of a training checkpoint (``state_dict`` entries under ``draft.``, without the prefix)."""
    state = checkpoint.get("state_dict", {})
    return {k[len("draft.") :]: v for k, v in state.items() if k.startswith("draft.")}
