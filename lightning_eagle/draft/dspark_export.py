"""Write a DSpark drafter in the layout vLLM 0.32's loader reads (``K3DSparkForCausalLM``, registry name
``K3DSparkModel``): ``config.json`` + ``model.safetensors``, and read it back.

``config.json``: ``architectures ["K3DSparkModel"]``, ``model_type "k3_dspark"`` and every field ``K3DSparkConfig``
(a ``DeepseekV3Config``) and the model read: the MLA and MLP widths, ``q_lora_rank``, ``rope_parameters``
(``{"rope_type": "default" | "yarn", "rope_theta", …}``: vLLM turns a non-default type into ``deepseek_yarn``),
``vocab_size`` = ``draft_vocab_size`` (shared with the target), ``target_hidden_size``, ``num_target_layers``,
``target_layer_ids`` (our 0-based taps, which are vLLM's DSpark numbering: its runner adds one to capture the state
entering layer ``i + 1``), ``block_size``, ``mask_token_id`` (what ``get_parallel_drafting_token_id`` reads),
``markov_rank``, ``enable_confidence_head`` + ``confidence_head_with_markov``, ``sample_from_anchor: true`` (slot 0
predicts: vLLM's ``DSparkSpeculator`` default, written explicitly). The K3 AttnRes stream the taps read is
recorded as ``aux_hidden_state_stream`` (the config's ``aux_stream``) and as the engine setting it needs under
``serving_env`` (``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM``), which :func:`dspark_serving_command` prints.

``model.safetensors``: the drafter's state under its own names (they are vLLM's, see
:mod:`lightning_eagle.draft.dspark`), floats in ``dtype`` (bf16 by default, what vLLM serves) except the confidence
head (fp32, vLLM's ``params_dtype``); no ``embed_tokens`` / ``lm_head`` (the target's; vLLM drops them anyway).
Written atomically (:func:`lightning_eagle.atomic.atomic_dir`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lightning_eagle import checkpoint_keys as keys
from lightning_eagle.atomic import atomic_dir, weights_folder_problem
from lightning_eagle.aux_layers import STREAM_EXPORT_KEY
from lightning_eagle.draft.dspark import DSparkDrafter
from lightning_eagle.draft.dspark_config import DSparkDraftConfig
from lightning_eagle.draft.family import DraftFamily, checkpoint_draft_state, checkpoint_family, register_draft_family
from lightning_eagle.draft.serving_format import (
    AUX_STREAM_ENV,
    AUX_STREAM_ENV_VALUE,
    SERVING_ENV_KEY,
    WRITE_ID_KEY,
    check_finite,
    new_write_id,
    read_safetensors,
    read_snapshot,
)

DSPARK_ARCHITECTURE = "K3DSparkModel"
DSPARK_MODEL_TYPE = "k3_dspark"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DSPARK = "dspark"  # the family's name in checkpoints and registries
# K3DSparkConfig raises on any of these set (the NoPE / gated / q-k-normed K3 MLA, the bonus anchor)
VLLM_REFUSED_FLAGS = ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor")
FP32_PREFIXES = ("confidence_head.",)  # vLLM keeps the confidence head in fp32
# The config's fields the export writes in another form (``rope_parameters``) or beside a derived twin
# (``num_target_layers``); every other field of DSparkDraftConfig is written and read under its own name (vLLM reads
# the architecture ones so; ours, like ``target_num_hidden_layers`` and ``aux_stream``, it ignores).
_FIELDS_WRITTEN_OTHERWISE = ("aux_layer_ids", "aux_stream", "rope_theta", "rope_scaling")
_PLAIN_FIELDS = tuple(f.name for f in dataclasses.fields(DSparkDraftConfig) if f.name not in _FIELDS_WRITTEN_OTHERWISE)
# what config.json must hold (the config's fields without a default, the taps under vLLM's name)
_REQUIRED_FIELDS = (
    *(f.name for f in dataclasses.fields(DSparkDraftConfig)
      if f.name in _PLAIN_FIELDS and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING),
    "target_layer_ids",
)  # fmt: skip


def rope_parameters(config: DSparkDraftConfig) -> dict[str, Any]:
    """What vLLM's K3 MLA builds its rotary from (``config.rope_parameters``)."""
    if config.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = {k: v for k, v in config.rope_scaling.items() if k not in ("type", "rope_type")}
    return {"rope_type": "yarn", "rope_theta": config.rope_theta, **scaling}


def dspark_config_json(config: DSparkDraftConfig, torch_dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the export (module docstring)."""
    data: dict[str, Any] = {name: getattr(config, name) for name in _PLAIN_FIELDS}
    data.update(
        architectures=[DSPARK_ARCHITECTURE],
        model_type=DSPARK_MODEL_TYPE,
        num_key_value_heads=config.num_attention_heads,
        draft_vocab_size=config.vocab_size,
        target_layer_ids=list(config.aux_layer_ids),
        num_target_layers=config.num_target_layers,
        confidence_head_with_markov=config.enable_confidence_head,
        # slot 0 (the anchor) predicts the first draft token: what we train (vLLM's default, written to be explicit)
        sample_from_anchor=True,
        rope_parameters=rope_parameters(config),
        tie_word_embeddings=False,
        torch_dtype=str(torch_dtype).removeprefix("torch."),
    )
    data[STREAM_EXPORT_KEY] = config.aux_stream
    data[SERVING_ENV_KEY] = {AUX_STREAM_ENV: AUX_STREAM_ENV_VALUE[config.aux_stream]}
    return data


def dspark_config_from_json(data: dict[str, Any]) -> DSparkDraftConfig:
    """Inverse of :func:`dspark_config_json`; refuses a folder of another architecture and what vLLM's
    ``K3DSparkConfig`` refuses (the flags of :data:`VLLM_REFUSED_FLAGS`, a draft vocabulary, a tap count that is not
    ``num_target_layers``; ``q_lora_rank: null`` and empty taps through :class:`DSparkDraftConfig`)."""
    if data.get("architectures") != [DSPARK_ARCHITECTURE] or data.get("model_type") != DSPARK_MODEL_TYPE:
        raise ValueError(
            f"not a DSpark export: architectures {data.get('architectures')!r}, model_type "
            f"{data.get('model_type')!r} (expected [{DSPARK_ARCHITECTURE!r}], {DSPARK_MODEL_TYPE!r})"
        )
    missing = [name for name in _REQUIRED_FIELDS if name not in data]
    if missing:
        raise ValueError(
            f"config.json: lacks the field(s) {missing} of a DSpark export (written by export_dspark_draft)"
        )
    refused = [name for name in VLLM_REFUSED_FLAGS if data.get(name)]
    if refused:
        raise ValueError(f"config.json sets {refused}: vLLM's MLA DSpark does not support them")
    if data.get("draft_vocab_size", data.get("vocab_size")) != data.get("vocab_size"):
        raise ValueError(
            f"config.json: draft_vocab_size {data['draft_vocab_size']} != vocab_size {data.get('vocab_size')}: the "
            "DSpark draft shares the target's embedding and LM head (vLLM refuses a draft vocabulary)"
        )
    if data.get("sample_from_anchor", True) is not True:
        raise ValueError(
            "config.json: sample_from_anchor must be true: this drafter is trained with the anchor as the first "
            "prediction (slot k predicts token anchor + k + 1), not the DFlash fill-in layout"
        )
    ids = data.get("target_layer_ids")
    if isinstance(ids, list) and data.get("num_target_layers", len(ids)) != len(ids):
        raise ValueError(
            f"config.json: num_target_layers {data['num_target_layers']} != len(target_layer_ids) {len(ids)}"
        )
    values = {name: data[name] for name in _PLAIN_FIELDS if name in data}
    values["aux_layer_ids"] = data["target_layer_ids"]
    if STREAM_EXPORT_KEY in data:
        values["aux_stream"] = data[STREAM_EXPORT_KEY]
    rope = dict(data.get("rope_parameters") or {"rope_type": "default", "rope_theta": 50000.0})
    values["rope_theta"] = rope.pop("rope_theta", 50000.0)
    kind = rope.pop("rope_type", "default")
    values["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    return DSparkDraftConfig(**values)


def dspark_export_state(drafter: DSparkDrafter, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors of the export: the drafter's state (its names are vLLM's), floats in ``dtype``, the confidence
    head fp32; contiguous CPU copies (safetensors refuses shared storage)."""
    out = {}
    for name, tensor in drafter.state_dict().items():
        want = torch.float32 if name.startswith(FP32_PREFIXES) else dtype
        out[name] = tensor.detach().to("cpu", want if tensor.is_floating_point() else tensor.dtype).contiguous().clone()
    return out


def export_dspark_draft(
    drafter: Any,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Export ``drafter`` (a :class:`DSparkDrafter`, or anything with one as ``.draft``) to ``out_dir`` atomically;
    ``overwrite`` may replace only a previous weights export. Returns the folder."""
    drafter = getattr(drafter, "draft", drafter)
    if not isinstance(drafter, DSparkDrafter):
        raise TypeError(f"export_dspark_draft takes a DSparkDrafter (or a module with one as .draft), got {drafter!r}")
    tensors = dspark_export_state(drafter, dtype)
    check_finite(tensors, f"refusing to export the DSpark draft of {type(drafter).__name__}")  # after the cast
    write_id = new_write_id()  # in both files: a reader pairs one write's config with its own weights
    config_json = {**dspark_config_json(drafter.config, dtype), WRITE_ID_KEY: write_id}
    out_dir = Path(out_dir)

    def replaceable(folder: Path) -> str | None:
        return weights_folder_problem(folder, frozenset({DSPARK_ARCHITECTURE}))

    with atomic_dir(out_dir, overwrite=overwrite, replaceable=replaceable) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", WRITE_ID_KEY: write_id})
        (tmp / CONFIG_NAME).write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        load_dspark_export(tmp)  # what was written is what a loader reads: refuse before the final name
    return out_dir


def load_dspark_export(folder: str | os.PathLike, dtype: torch.dtype | None = None) -> DSparkDrafter:
    """A :class:`DSparkDrafter` from an export: one write's ``config.json`` and weights (even while a fit replaces
    the folder: :func:`~lightning_eagle.draft.serving_format.read_snapshot`), every field the config needs, every
    tensor present with the drafter's shape and the dtype the config names (the confidence head fp32), finite,
    nothing extra; each refusal one ``ValueError`` naming the file."""
    folder = Path(folder)
    config_file, weights = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    config_json, state = read_snapshot(folder, lambda: _read_config(config_file), lambda: _read_weights(weights))
    try:
        config = dspark_config_from_json(config_json)
    except (TypeError, ValueError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        raise ValueError(f"{config_file}: {message.removeprefix('config.json: ')}") from None
    check_finite(state, str(weights))
    _check_dtypes(state, config_json, config, weights)
    drafter = drafter_holding(config, state, str(weights))
    return drafter if dtype is None else drafter.to(dtype)


def _read_config(config_file: Path) -> dict[str, Any]:
    if not config_file.is_file():
        raise FileNotFoundError(
            f"DSpark export {str(config_file.parent)!r} has no {CONFIG_NAME} (expected {config_file})"
        )
    try:
        data = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_file}: invalid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config_file}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_weights(weights: Path) -> tuple[dict[str, torch.Tensor], set[str | None]]:
    if not weights.is_file():
        raise FileNotFoundError(f"DSpark export {str(weights.parent)!r} has no {WEIGHTS_NAME} (expected {weights})")
    state, write_id = read_safetensors(weights)
    return state, {write_id}


def _check_dtypes(state: dict[str, torch.Tensor], config_json: dict[str, Any], config, weights: Path) -> None:
    """Every tensor in the dtype the export's writer gives it (never cast silently on load): floats in
    ``config.json``'s ``torch_dtype``, the confidence head fp32, anything else the drafter's own dtype."""
    name = config_json.get("torch_dtype")
    floats = getattr(torch, str(name), None) if name is not None else None
    if name is not None and not (isinstance(floats, torch.dtype) and floats.is_floating_point):
        raise ValueError(f"{weights.parent / CONFIG_NAME}: torch_dtype {name!r} is not a floating dtype")
    with torch.device("meta"):
        own = {k: v.dtype for k, v in DSparkDrafter(config).state_dict().items()}
    for key, tensor in state.items():
        if key not in own:
            continue  # an unexpected tensor: drafter_holding names it with the rest
        if not own[key].is_floating_point:
            want, why = own[key], "the drafter's"
        elif key.startswith(FP32_PREFIXES):
            want, why = torch.float32, "vLLM keeps the confidence head in fp32"
        elif floats is not None:
            want, why = floats, f"config.json torch_dtype {name!r}"
        else:
            want, why = None, ""
        if want is not None and tensor.dtype != want:
            raise ValueError(f"{weights}: tensor {key!r} is stored as {tensor.dtype}, expected {want} ({why})")
        if want is None and not tensor.is_floating_point():
            raise ValueError(f"{weights}: tensor {key!r} is stored as {tensor.dtype}, expected a floating dtype")


def drafter_holding(config: DSparkDraftConfig, state: dict[str, torch.Tensor], source: str) -> DSparkDrafter:
    """A :class:`DSparkDrafter` of ``config`` holding ``state`` (floats as fp32), loaded strictly: a missing, extra or
    wrongly shaped tensor is one ``ValueError`` that names ``source`` and the tensors (an export, a checkpoint)."""
    drafter = DSparkDrafter(config)
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    if found != expected:
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        wrong = sorted(k for k in set(found) & set(expected) if found[k] != expected[k])
        raise ValueError(
            f"{source}: not the tensors of its config (missing {missing[:5]}, unexpected {extra[:5]}, wrong shapes "
            f"{[(k, found[k], expected[k]) for k in wrong[:5]]})"
        )
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return drafter


def dspark_drafter_from_checkpoint(checkpoint: dict[str, Any]) -> DSparkDrafter:
    """The drafter of a DSpark training checkpoint (``state_dict`` under ``draft.``, the config under the shared
    :data:`~lightning_eagle.checkpoint_keys.DRAFT_CONFIG`), loaded strictly (:func:`drafter_holding`)."""
    family = checkpoint_family(checkpoint)
    if family.name != DSPARK:
        raise ValueError(f"the checkpoint holds a {family.name} draft, not a DSpark one (cli.py export reads it)")
    config = DSparkDraftConfig.from_dict(checkpoint[keys.DRAFT_CONFIG])
    return drafter_holding(config, checkpoint_draft_state(checkpoint), "the checkpoint's DSpark draft")


def dspark_serving_command(
    config_json: dict[str, Any],
    folder: str,
    target: str = "<K3 checkpoint>",
    draft_sample_method: str = "greedy",
    rejection_sample_method: str = "standard",
) -> str:
    """The ``vllm serve`` line for the export at ``folder`` (``num_speculative_tokens`` = the block size), with the
    engine setting of the recorded AttnRes stream in front."""
    env = config_json.get(SERVING_ENV_KEY) or {}
    prefix = "".join(f"{k}={v} " for k, v in sorted(env.items()))
    spec = {
        "method": "dspark",
        "model": folder,
        "num_speculative_tokens": config_json["block_size"],
        "draft_sample_method": draft_sample_method,
        "rejection_sample_method": rejection_sample_method,
    }
    return f"{prefix}vllm serve {target} --speculative-config '{json.dumps(spec)}'"


# ---- the family record -----------------------------------------------------------------------------------------------
def _recognizes(config_json: dict[str, Any]) -> bool:
    names = config_json.get("architectures") or []
    return isinstance(names, list) and DSPARK_ARCHITECTURE in names


def _export(source: Any, out_dir, *, dtype=None, overwrite=False, include_embeddings=None) -> Path:
    if include_embeddings:
        raise ValueError(
            "--include-embeddings: a DSpark draft shares the target's embedding and LM head (vLLM refuses its own)"
        )
    drafter = dspark_drafter_from_checkpoint(source) if isinstance(source, dict) else source
    return export_dspark_draft(drafter, out_dir, dtype=dtype or torch.bfloat16, overwrite=overwrite)


register_draft_family(DraftFamily(
    name=DSPARK, config_type=DSparkDraftConfig, is_draft=lambda draft: isinstance(draft, DSparkDrafter),
    recognizes=_recognizes,
    load_export=lambda folder, target, dtype, device: load_dspark_export(folder, dtype).to(device),
    export=_export, serve_lines=lambda config_json, folder: [dspark_serving_command(config_json, folder)],
    aux_layer_ids=lambda config: list(config.aux_layer_ids), legacy_config_keys=("dspark_draft_config",),
    layers={"training": "lightning_eagle.training.dspark_module",
            "decoding": "lightning_eagle.inference.block_speculative",
            "planning": "lightning_eagle.planning.dspark_plan"},
))  # fmt: skip
