"""Write a draft in the serving layout (`eagle3_training.md` §14): ``config.json`` + ``model.safetensors``.

The format follows the draft's architecture (:mod:`lightning_eagle.draft.serving_format`): a K3-faithful draft is
written as ``Eagle3KimiK3ForCausalLM`` (vLLM serves it through our plugin, :mod:`lightning_eagle.serving`), a
``deepseek_mla`` draft as
``Eagle3DeepseekV2ForCausalLM`` in exactly the layout SGLang and vLLM load (bf16 by default, ``layers.0.*``,
one-based aux ids). The engines feed that draft the target's *prefix* aux stream, so only a draft trained on
``aux_stream: prefix`` is exported in the engine format.

Sources: a :class:`KimiK3Eagle3Draft`, anything with a ``.draft`` attribute (the Lightning module), a ``torch.save``'d
checkpoint file (``{"state_dict": {"draft.…": …}, "draft_family": "eagle3", "draft_config": config dict, …}``), or a
DCP checkpoint folder (converted single-process with ``dcp_to_torch_save``, the way ``lightning_notes.md`` §7
verified, with the run's record from Lightning's ``meta.pt``:
:func:`~lightning_eagle.checkpoint_io.load_dcp_checkpoint`). The write is atomic: everything goes to a temporary
sibling folder that is renamed into place only after every check passed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lightning_eagle import checkpoint_keys as keys
from lightning_eagle.atomic import atomic_dir, weights_folder_problem
from lightning_eagle.checkpoint_io import load_checkpoint_file, load_dcp_checkpoint
from lightning_eagle.draft import serving_format as fmt
from lightning_eagle.draft.config import TRAINING_SETTINGS, Eagle3DraftConfig
from lightning_eagle.draft.family import DraftFamily, checkpoint_family, register_draft_family
from lightning_eagle.draft.model import KimiK3Eagle3Draft
from lightning_eagle.draft.pretrained import check_export

EAGLE3 = "eagle3"  # the family's name in checkpoints and registries
_STRIP = ("_orig_mod.", "module.")


def export_draft(
    source: Any,
    out_dir: str | os.PathLike,
    *,
    config: Eagle3DraftConfig | None = None,
    aux_layer_ids: list[int] | None = None,
    aux_stream: str | None = None,
    include_embeddings: bool | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    architecture: str | None = None,
    training: dict[str, Any] | None = None,
) -> Path:
    """Export ``source`` to ``out_dir`` and return the folder.

    ``include_embeddings=None`` writes ``embed_tokens.weight`` only when the embedding was trained
    (``config.freeze_embeddings`` false): a frozen copy equals the target's, which engines share. ``aux_layer_ids`` /
    ``aux_stream`` override the config's record (required when the config has none). ``dtype`` casts the
    floating tensors (e.g. ``torch.bfloat16``; None = as trained for the K3 format, bf16 for the engine format, the
    dtype engines serve drafts in); ``d2t``/``t2d`` keep int64/bool. ``architecture`` (None = the draft's own) is
    checked, never rewritten: asking for an engine name with a K3-faithful draft raises ``ValueError``.
    ``training`` (``ttt_steps``, ``step_decay``) is recorded as metadata; a checkpoint brings its own.
    """
    state, config, recorded = _resolve_source(source, config)
    training = recorded if training is None else training
    fmt.check_architecture_name(config, architecture)
    changes = {}
    if aux_layer_ids is not None:
        changes["aux_layer_ids"] = list(aux_layer_ids)
    if aux_stream is not None:
        changes["aux_stream"] = aux_stream
    if changes:
        config = config.replace(**changes)
    if include_embeddings is None:
        include_embeddings = not config.freeze_embeddings
    if not include_embeddings:
        state.pop("embed_tokens.weight", None)
    if dtype is None and config.architecture == "deepseek_mla":
        dtype = torch.bfloat16
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if config.aux_layer_ids is not None:  # None: config_to_json refuses with the reason
        state, config = fmt.to_engine_aux_order(state, config)  # both formats are served by vLLM, which sorts ids
    fmt.check_finite(state, f"refusing to export {_source_name(source)}")  # after the cast: fp16 may overflow to inf
    torch_dtype = fmt.check_state(state, config, include_embeddings)
    config_json = fmt.config_to_json(config, torch_dtype, training)
    # safetensors refuses shared / non-contiguous storage; a detached contiguous CPU copy of each tensor is safe.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in fmt.to_serving_names(state, config).items()}
    return _atomic_write(Path(out_dir), tensors, config_json, overwrite)


def previous_export_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a previous draft export that ``overwrite`` may replace (None: it is one, or empty)."""
    return weights_folder_problem(folder, frozenset({fmt.ARCHITECTURE, fmt.ENGINE_ARCHITECTURE}))


def _source_name(source: Any) -> str:
    """How a refusal names the export's source: the checkpoint's path, or what kind of object it is."""
    if isinstance(source, (str, os.PathLike)):
        return f"checkpoint {str(source)!r}"
    return "the checkpoint" if isinstance(source, dict) else f"the draft of {type(source).__name__}"


def _atomic_write(out_dir: Path, tensors: dict[str, torch.Tensor], config_json: dict, overwrite: bool) -> Path:
    write_id = fmt.new_write_id()  # in both files: a reader pairs one write's config with its own weights
    config_json = {**config_json, fmt.WRITE_ID_KEY: write_id}
    with atomic_dir(out_dir, overwrite=overwrite, replaceable=previous_export_problem) as tmp:
        save_file(tensors, str(tmp / fmt.WEIGHTS_NAME), metadata={"format": "pt", fmt.WRITE_ID_KEY: write_id})
        with open(tmp / fmt.CONFIG_NAME, "w") as f:
            json.dump(config_json, f, indent=2, sort_keys=True)
            f.write("\n")
        check_export(tmp)  # what was written is what a loader will read: refuse before it takes the final name
    return out_dir


# ---- sources ---------------------------------------------------------------------------------------------------------
def _resolve_source(source: Any, config: Eagle3DraftConfig | None) -> tuple[dict, Eagle3DraftConfig, dict | None]:
    """``(draft state, config, training settings or None)`` of a draft, a checkpoint dict, file or DCP folder."""
    draft = getattr(source, "draft", source)
    if isinstance(draft, KimiK3Eagle3Draft):  # a training module says how it trained (the export's default K)
        training = source.training_record() if hasattr(source, "training_record") else None
        return dict(draft.state_dict()), config or draft.config, training
    if isinstance(source, dict):
        return _from_checkpoint_dict(source, config)
    path = Path(source)
    if path.is_dir():
        return _from_checkpoint_dict(load_dcp_checkpoint(path), config)
    if path.is_file():
        return _from_checkpoint_dict(load_checkpoint_file(path, weights_only=False), config)
    raise FileNotFoundError(f"export source {source!r} is neither a draft module nor an existing checkpoint")


def _from_checkpoint_dict(ckpt: dict, config: Eagle3DraftConfig | None) -> tuple[dict, Eagle3DraftConfig, dict | None]:
    family = checkpoint_family(ckpt, required=False)  # None: a bare state dict (``config`` names its draft)
    if family is not None and family.name != EAGLE3:
        raise ValueError(f"the checkpoint holds a {family.name} draft, not an EAGLE-3 one (cli.py export reads it)")
    data = ckpt.get(keys.DRAFT_CONFIG)
    # Checkpoints written before the training settings left the draft config hold them inside it.
    training = ckpt.get(keys.DRAFT_TRAINING) or {k: data[k] for k in TRAINING_SETTINGS if k in (data or {})}
    if config is None:
        if data is None:
            raise ValueError(
                f"the checkpoint has no {keys.DRAFT_CONFIG!r} entry; pass config=Eagle3DraftConfig(...) to export_draft"
            )
        config = Eagle3DraftConfig.from_dict(data)
    state = ckpt.get("state_dict", ckpt)
    return draft_state_from_trainer_state(state), config, training or None


def draft_state_from_trainer_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Keep the ``draft.``-prefixed entries of a trainer state dict (dropping ``_orig_mod.`` / ``module.`` wrappers);
    a state with no ``draft.`` keys is taken as a bare draft state dict."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if any(k.startswith("draft.") for k in tensors):
        tensors = {k[len("draft.") :]: v for k, v in tensors.items() if k.startswith("draft.")}
    out = {}
    for key, value in tensors.items():
        for wrapper in _STRIP:
            key = key.replace(wrapper, "")
        out[key] = value
    return out


# ---- the family record -----------------------------------------------------------------------------------------------
def _recognizes(config_json: dict[str, Any]) -> bool:
    names = config_json.get("architectures") or []
    return isinstance(names, list) and any(n == fmt.ARCHITECTURE or n in fmt.ENGINE_ARCHITECTURE_NAMES for n in names)


def _load_export(folder: Path, target, dtype: torch.dtype, device: str) -> KimiK3Eagle3Draft:
    """The draft (one write's config and weights: ``from_pretrained`` reads a snapshot,
    :func:`~lightning_eagle.draft.serving_format.read_snapshot`) and the training settings its ``config.json``
    records, read before and after the load: the same write id both times means no write replaced the folder in
    between (ids are never reused), so the settings are that draft's; otherwise it is read again."""
    embedding = None if target is None else target.model.embed_tokens.weight
    config_file = Path(folder) / fmt.CONFIG_NAME
    for attempt in range(fmt.SNAPSHOT_READS):
        last = attempt == fmt.SNAPSHOT_READS - 1
        try:
            before = _recorded(config_file).get(fmt.WRITE_ID_KEY)  # a bad file: from_pretrained says why
            draft = KimiK3Eagle3Draft.from_pretrained(folder, target_embedding=embedding, dtype=dtype, device=device)
            recorded = _recorded(config_file)
        except FileNotFoundError:  # between the two renames of a folder swap
            if last:
                raise
            continue
        if recorded.get(fmt.WRITE_ID_KEY) == before:
            break
        if last:
            raise ValueError(
                f"{folder}: the export was replaced during each of {fmt.SNAPSHOT_READS} reads; read it "
                "when the writer is done"
            )
    # how it was trained (ttt_steps: the K its decoding drafts by default), as the export records it
    draft.training_settings = {k: recorded[k] for k in TRAINING_SETTINGS if k in recorded}
    return draft


def _recorded(config_file: Path) -> dict[str, Any]:
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError):  # missing mid-swap, or bad: the load says why, or reads again
        return {}
    return data if isinstance(data, dict) else {}


def _export(source: Any, out_dir, *, dtype=None, overwrite=False, include_embeddings=None) -> Path:
    return export_draft(source, out_dir, dtype=dtype, include_embeddings=include_embeddings, overwrite=overwrite)


register_draft_family(DraftFamily(
    name=EAGLE3, config_type=Eagle3DraftConfig, is_draft=lambda draft: isinstance(draft, KimiK3Eagle3Draft),
    recognizes=_recognizes, load_export=_load_export, export=_export, serve_lines=fmt.serving_instructions,
    aux_layer_ids=lambda config: getattr(config, "aux_layer_ids", None), legacy_config_keys=("eagle_draft_config",),
    layers={"training": "lightning_eagle.training.module", "decoding": "lightning_eagle.inference.eagle3_decoding",
            "planning": "lightning_eagle.planning.eagle3_plan"}, default=True,
    resumable_fields=("draft_vocab_size", *TRAINING_SETTINGS),
))  # fmt: skip
