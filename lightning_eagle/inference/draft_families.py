"""Which draft family an export is, read from its ``config.json``, and how to load it for speculative decoding.

A family recognises its exports by their ``config.json`` and loads one as an object
:func:`~lightning_eagle.inference.speculative_generate` drafts with (a draft model, or any
:class:`~lightning_eagle.inference.draft_runner.Drafter`). Today the one family is EAGLE-3 (chain drafting, both
draft architectures and NeMo Automodel exports: ``architectures`` names an EAGLE-3 head) and DSpark (block drafting,
vLLM's ``K3DSparkModel`` layout). Each family also names its decoding loop (``generate``, with
:func:`~lightning_eagle.inference.speculative_generate`'s signature), which :func:`generate_for` picks for a loaded
draft, and :func:`decoding_loop` holds it for a ``with`` block in eval mode.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class DraftFamily:
    """``recognizes(config_json)``: the export is of this family; ``load(folder, target, dtype, device)``: the draft,
    ready to decode against ``target`` (its missing frozen embedding filled from the target's)."""

    name: str
    recognizes: Callable[[dict[str, Any]], bool]
    load: Callable[[Path, Any, torch.dtype, str], Any]
    generate: Callable[..., Any] | None = None  # None: speculative_generate (chain drafting)
    is_draft: Callable[[Any], bool] | None = None  # which loaded objects are this family's (for generate_for)


DRAFT_FAMILIES: dict[str, DraftFamily] = {}


def register_draft_family(family: DraftFamily) -> DraftFamily:
    """Add ``family`` (its name must be new)."""
    if family.name in DRAFT_FAMILIES:
        raise ValueError(f"draft family {family.name!r} is already registered")
    DRAFT_FAMILIES[family.name] = family
    return family


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


def draft_family(config_json: dict[str, Any], source: str = "config.json") -> DraftFamily:
    """The one registered family that recognises ``config_json``; none or several is a ``ValueError``."""
    matches = [f for f in DRAFT_FAMILIES.values() if f.recognizes(config_json)]
    if len(matches) != 1:
        found = "no draft family" if not matches else "several draft families (" + ", ".join(f.name for f in matches)
        raise ValueError(
            f"{source}: {found}{')' if matches else ''} recognise architectures={config_json.get('architectures')!r}; "
            f"known families: {', '.join(DRAFT_FAMILIES)}"
        )
    return matches[0]


def load_draft(folder: str | Path, target, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[str, Any]:
    """``(family name, draft)`` for the export at ``folder``, its family read from its ``config.json``."""
    if not Path(folder).is_dir():
        raise ValueError(f"draft folder {str(folder)!r} does not exist")
    family = draft_family(export_config(folder), str(Path(folder) / "config.json"))
    return family.name, family.load(Path(folder), target, dtype, device)


def _is_eagle3(config_json: dict[str, Any]) -> bool:
    from lightning_eagle.draft.serving_format import ARCHITECTURE, ENGINE_ARCHITECTURE_NAMES

    names = config_json.get("architectures") or []
    return isinstance(names, list) and any(n == ARCHITECTURE or n in ENGINE_ARCHITECTURE_NAMES for n in names)


def _load_eagle3(folder: Path, target, dtype: torch.dtype, device: str):
    from lightning_eagle.draft import KimiK3Eagle3Draft

    return KimiK3Eagle3Draft.from_pretrained(
        folder, target_embedding=target.model.embed_tokens.weight, dtype=dtype, device=device
    )


def _is_dspark(config_json: dict[str, Any]) -> bool:
    from lightning_eagle.draft.dspark_export import DSPARK_ARCHITECTURE

    names = config_json.get("architectures") or []
    return isinstance(names, list) and DSPARK_ARCHITECTURE in names


def _load_dspark(folder: Path, target, dtype: torch.dtype, device: str):
    from lightning_eagle.draft.dspark_export import load_dspark_export

    return load_dspark_export(folder, dtype).to(device)


def _block_generate(target, drafter, prompt_ids, max_new_tokens=64, num_draft_tokens=None, temperature=0.0,
                    seed=None, aux_layer_ids=None, **options):  # fmt: skip
    from lightning_eagle.inference.block_speculative import block_speculative_generate

    if aux_layer_ids is not None:  # a block drafter's taps are its config's target_layer_ids, nothing else
        raise ValueError(f"aux_layer_ids={aux_layer_ids!r}: a DSpark drafter taps its own target_layer_ids")
    return block_speculative_generate(target, drafter, prompt_ids, max_new_tokens, num_draft_tokens, temperature,
                                      seed, **options)  # fmt: skip


def _is_dspark_drafter(draft: Any) -> bool:
    from lightning_eagle.draft.dspark import DSparkDrafter

    return isinstance(draft, DSparkDrafter)


@contextmanager
def decoding_loop(draft: Any) -> Iterator[Callable[..., Any]]:
    """The loop of ``draft``'s family (:func:`generate_for`) for the ``with`` block, a draft in training mode (the
    acceptance callback's) switched to eval mode for it (no dropout while decoding) and back after."""
    was_training = bool(getattr(draft, "training", False))
    if was_training:
        draft.eval()
    try:
        yield generate_for(draft)
    finally:
        if was_training:
            draft.train()


def generate_for(draft: Any) -> Callable[..., Any]:
    """The decoding loop of ``draft``'s family (chains for anything no family claims: any Drafter object)."""
    from lightning_eagle.inference.speculative import speculative_generate

    for family in DRAFT_FAMILIES.values():
        if family.is_draft is not None and family.generate is not None and family.is_draft(draft):
            return family.generate
    return speculative_generate


register_draft_family(DraftFamily("eagle3", _is_eagle3, _load_eagle3))
register_draft_family(DraftFamily("dspark", _is_dspark, _load_dspark, _block_generate, _is_dspark_drafter))
