"""The serving export formats of the draft (`eagle3_training.md` §14): the exact key set with shapes and dtypes, and
the ``config.json`` fields, in both directions. Writing is :mod:`lightning_eagle.draft.export`; reading is
:meth:`~lightning_eagle.draft.KimiK3Eagle3Draft.from_pretrained` (checked by
:func:`~lightning_eagle.draft.pretrained.check_export`).

Two formats, one per draft architecture:

* ``architecture="k3"`` → ``Eagle3KimiK3ForCausalLM`` (§14.2): our layout (``midlayer.*``, which vLLM's EAGLE-3
  loaders rename to ``layers.0.``), ``model_type "kimi_k2"`` (§14.2 keeps the reference's ``kimi_linear``; vLLM
  parses the MLA fields with the DeepSeek-V3 class). vLLM serves it through our plugin
  (:mod:`lightning_eagle.serving.vllm_k3_draft`); an engine without the plugin refuses the unknown architecture
  loudly instead of serving the gated SiTU layer as something else.
* ``architecture="deepseek_mla"`` → ``Eagle3DeepseekV2ForCausalLM`` with ``model_type "kimi_k2"``: what vLLM 0.32
  (``vllm/model_executor/models/deepseek_eagle3.py``, proven with vLLM's own code in ``tests/engine``) and SGLang
  (``python/sglang/srt/models/kimi_k25_eagle3.py``) load. ``model_type`` matters: vLLM rewrites any draft whose
  ``model_type`` is ``deepseek_v3`` into a DeepSeek MTP config (``SpeculativeConfig.hf_config_override``) and then
  asks for a class that does not exist; ``kimi_k2`` (what the published Kimi EAGLE-3 drafts carry) maps to the same
  DeepSeek-V3 config class without that rewrite. Weights ``fc`` (+ ``fc_norm.i``), ``layers.0.*``, ``norm``,
  ``lm_head``, ``d2t``, ``t2d`` (and ``embed_tokens`` only when trained); unfused ``q_a_proj`` /
  ``kv_a_proj_with_mqa`` and ``gate_proj`` / ``up_proj`` (the loaders fuse them); ``d2t`` = target id − draft id
  (both loaders add ``arange``), ``t2d`` written for our re-import and skipped by both.

Aux ids (vLLM 0.32, ``EagleModelMixin._set_aux_hidden_state_layers`` and the K3 / DeepSeek target models): an engine
id ``j`` is the hidden state *entering* target layer ``j`` (the output of layer ``j - 1``), so our 0-based tap ``i`` is
engine id ``i + 1`` (K3: ``[1, 45, 89]`` → ``[2, 46, 90]``); vLLM **sorts and de-duplicates** the ids and its V2 model
runner reads only the **top-level** ``eagle_aux_hidden_state_layer_ids`` (the V1 runner reads ``eagle_config``), so
both formats write the one-based ids in both places, ascending; a draft trained on ids in another order is exported
with ``fc``'s input columns (and ``fc_norm``) permuted to that order (:func:`to_engine_aux_order`), which computes the
same function. Our own 0-based ids, in ``fc`` order, are the project field ``aux_layer_ids``. Our tap ``L`` (the
pre-norm final state, `k3_target.md` §6.4) would be engine id ``L + 1``, which no engine captures: refused.

SGLang 0.5.23 (read, not run: it does not install on CPU) reads the ids from ``eagle_config`` only, uses them as
given except that it adds 1 to all of them when the first is 1 (so exporting a draft that taps our layer 0 warns),
and has no EAGLE-3 capture in its K3 model (``kimi_k3.py``: DFlash/DSpark only); its ``Eagle3DeepseekV2ForCausalLM``
(``kimi_k25_eagle3.py``) loads the same names, registers ``kimi_k2`` as a DeepSeek-V3 config, serves ``fc_norm`` and
``norm_output``, and skips unknown weights (``g_proj``) with only a warning.

Aux stream: vLLM's K3 model captures the *prefix* stream by default and the AttnRes ``"mixed"`` stream (the mixture
that layer ``j`` reads) with ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1``; the export records the setting the draft needs
under ``serving_env`` and ``cli.py export`` prints it (:func:`serving_instructions`).
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from lightning_eagle.aux_layers import STREAM_EXPORT_KEY
from lightning_eagle.aux_layers import validate_aux_layer_ids as validate_taps
from lightning_eagle.draft.config import (
    DEEPSEEK_MLA_LAYER_VALUES,
    DEFAULT_ROPE_THETA,
    FIELDS_FROM_TARGET,
    NUM_AUX_HIDDEN_STATES,
    TAP_REASONS,
    TRAINING_SETTINGS,
    Eagle3DraftConfig,
)
from lightning_eagle.draft.reference_import import sort_vocabulary

ARCHITECTURE = "Eagle3KimiK3ForCausalLM"  # served by our vLLM plugin (lightning_eagle.serving); refused without it
ENGINE_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # SGLang and vLLM (vLLM also aliases Eagle3DeepseekV3ForCausalLM)
ENGINE_MODEL_TYPE = "kimi_k2"  # not deepseek_v3: vLLM turns that into a DeepSeek MTP draft (module docstring)
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"  # one-based, the engines' numbering
SERVING_ENV_KEY = "serving_env"  # the engine environment the draft needs, e.g. the K3 aux stream
AUX_STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
AUX_STREAM_ENV_VALUE = {"prefix": "0", "mixed": "1"}
ENGINE_LAYER_PREFIX = "layers.0."  # the checkpoint name of the one layer (SGLang renames it to midlayer.)
# Architecture strings that engines map to a head: never written for a K3-faithful draft.
ENGINE_ARCHITECTURE_NAMES = frozenset(
    {
        ENGINE_ARCHITECTURE,
        "Eagle3DeepseekV3ForCausalLM",
        "LlamaForCausalLMEagle3",
        "Eagle3LlamaForCausalLM",
        "LlamaEagle3DraftModel",
        "EagleLlamaForCausalLM",
    }
)
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TRAINER_PREFIXES = ("draft.", "model.", "module.", "_orig_mod.")
FLOAT = "float"  # any floating dtype; all float tensors of one export share ``torch_dtype``

# Config fields copied 1:1 between Eagle3DraftConfig and config.json.
_PLAIN_FIELDS = (
    *FIELDS_FROM_TARGET,
    "draft_vocab_size",
    "target_hidden_size",
    "fc_norm",
    "norm_output",
    # project fields
    "aux_stream",
    "target_num_hidden_layers",
    "freeze_embeddings",
    "initializer_range",
)


def expected_keys(config: Eagle3DraftConfig, include_embeddings: bool) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Every draft state key (our ``midlayer.*`` names) → (shape, dtype or ``FLOAT``); nothing else may be written.
    Both architectures share the frame; the deepseek_mla layer has no ``g_proj`` (and its MLP is SwiGLU with the
    same three matrix shapes). The engine format renames ``midlayer.`` (:func:`to_serving_names`)."""
    c = config
    H, H_t, n = c.hidden_size, c.target_hidden_size, c.num_attention_heads
    two_h = 2 * H
    keys: dict[str, tuple[tuple[int, ...], Any]] = {"fc.weight": ((H, NUM_AUX_HIDDEN_STATES * H_t), FLOAT)}
    if c.fc_norm:
        for i in range(NUM_AUX_HIDDEN_STATES):
            keys[f"fc_norm.{i}.weight"] = ((H_t,), FLOAT)
    m = "midlayer."
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        keys[f"{m}{name}.weight"] = ((H,), FLOAT)
    a = f"{m}self_attn."
    if c.q_lora_rank is None:
        keys[f"{a}q_proj.weight"] = ((n * c.qk_head_dim, two_h), FLOAT)
    else:
        keys[f"{a}q_a_proj.weight"] = ((c.q_lora_rank, two_h), FLOAT)
        keys[f"{a}q_a_layernorm.weight"] = ((c.q_lora_rank,), FLOAT)
        keys[f"{a}q_b_proj.weight"] = ((n * c.qk_head_dim, c.q_lora_rank), FLOAT)
    keys[f"{a}kv_a_proj_with_mqa.weight"] = ((c.kv_lora_rank + c.qk_rope_head_dim, two_h), FLOAT)
    keys[f"{a}kv_a_layernorm.weight"] = ((c.kv_lora_rank,), FLOAT)
    keys[f"{a}kv_b_proj.weight"] = ((n * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), FLOAT)
    if c.architecture == "k3" and c.mla_use_output_gate:
        keys[f"{a}g_proj.weight"] = ((n * c.v_head_dim, two_h), FLOAT)
    keys[f"{a}o_proj.weight"] = ((H, n * c.v_head_dim), FLOAT)
    keys[f"{m}mlp.gate_proj.weight"] = ((c.intermediate_size, H), FLOAT)
    keys[f"{m}mlp.up_proj.weight"] = ((c.intermediate_size, H), FLOAT)
    keys[f"{m}mlp.down_proj.weight"] = ((H, c.intermediate_size), FLOAT)
    keys["norm.weight"] = ((H,), FLOAT)
    keys["lm_head.weight"] = ((c.draft_vocab_size, H), FLOAT)
    keys["d2t"] = ((c.draft_vocab_size,), torch.int64)
    keys["t2d"] = ((c.vocab_size,), torch.bool)
    if include_embeddings:
        keys["embed_tokens.weight"] = ((c.vocab_size, H), FLOAT)
    return keys


def check_state(
    state: dict[str, torch.Tensor],
    config: Eagle3DraftConfig,
    include_embeddings: bool,
    float_dtype: torch.dtype | None = None,
) -> torch.dtype:
    """Refuse anything but the exact key set (shapes, dtypes, no trainer prefixes); returns the float dtype.
    ``float_dtype`` (a loader: ``config.json``'s ``torch_dtype``) is the one dtype every float tensor must have."""
    prefixed = sorted(k for k in state if k.startswith(TRAINER_PREFIXES))
    if prefixed:
        raise ValueError(f"export keys carry trainer prefixes {TRAINER_PREFIXES}: {prefixed[:5]}")
    expected = expected_keys(config, include_embeddings)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"export key set mismatch: missing {missing}, unexpected {unexpected}")
    float_dtypes = set()
    for key, (shape, dtype) in expected.items():
        tensor = state[key]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"export key {key}: shape {tuple(tensor.shape)}, expected {shape}")
        if dtype is FLOAT:
            if float_dtype is not None and tensor.dtype != float_dtype:
                raise ValueError(
                    f"export key {key}: dtype {tensor.dtype}, expected {float_dtype} (config.json torch_dtype)"
                )
            if not tensor.is_floating_point():
                raise ValueError(f"export key {key}: dtype {tensor.dtype}, expected a floating dtype")
            float_dtypes.add(tensor.dtype)
        elif tensor.dtype != dtype:
            raise ValueError(f"export key {key}: dtype {tensor.dtype}, expected {dtype}")
    if len(float_dtypes) != 1:
        raise ValueError(f"export float tensors must share one dtype, got {sorted(map(str, float_dtypes))}")
    check_vocab_map(state["d2t"], state["t2d"])
    return float_dtypes.pop()


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """``arange + d2t`` must be ascending and equal ``nonzero(t2d)`` (§9 invariants)."""
    selected = torch.arange(d2t.numel()) + d2t.cpu()
    if not torch.equal(torch.nonzero(t2d.cpu()).flatten(), selected):
        raise ValueError("d2t/t2d disagree: arange(N_d) + d2t must equal nonzero(t2d) in ascending order (§9)")


def architecture_name(config: Eagle3DraftConfig) -> str:
    """The ``architectures`` string of ``config``'s export."""
    return ENGINE_ARCHITECTURE if config.architecture == "deepseek_mla" else ARCHITECTURE


def check_architecture_name(config: Eagle3DraftConfig, name: str | None) -> str:
    """``name`` (None = the draft's own) if it is the one this draft can be exported as; else ``ValueError``."""
    own = architecture_name(config)
    if name is None or name == own:
        return own
    if config.architecture == "k3":
        engines = " (an engine head)" if name in ENGINE_ARCHITECTURE_NAMES else ""
        raise ValueError(
            f"refusing to export the K3-faithful draft (architecture='k3': NoPE gated MLA + SiTU) as {name!r}"
            f"{engines}: engines skip unknown weights such as g_proj with only a warning and would serve another "
            f"function (SwiGLU, rotary, no gate). It is exported as {ARCHITECTURE!r}. For a draft SGLang and vLLM "
            f"serve, train with draft: {{architecture: deepseek_mla}} (Eagle3DraftConfig(architecture="
            f"'deepseek_mla')), exported as {ENGINE_ARCHITECTURE!r}"
        )
    raise ValueError(f"a deepseek_mla draft is exported as {own!r} (what the engines load), not as {name!r}")


def _json_name(field: str) -> str:
    """The export's name of a config field (the stream keeps the spec's ``aux_hidden_state_stream``)."""
    return STREAM_EXPORT_KEY if field == "aux_stream" else field


def config_to_json(
    config: Eagle3DraftConfig, torch_dtype: torch.dtype, training: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The export's ``config.json`` (§14.2, or the engine format for deepseek_mla), with the training settings the
    draft was trained with (``ttt_steps``, ``step_decay``) as metadata when known. Refuses a draft whose aux ids are
    unknown: engines cannot serve it correctly."""
    if config.aux_layer_ids is None or config.aux_stream is None:
        raise ValueError(
            "the draft config does not record which target aux states it was trained on (aux_layer_ids / "
            "aux_stream are None, e.g. a draft imported from a reference export); pass aux_layer_ids= "
            "and aux_stream= to export_draft"
        )
    metadata = {k: v for k, v in (training or {}).items() if k in TRAINING_SETTINGS}
    if config.architecture == "deepseek_mla":
        return {**engine_config_to_json(config, torch_dtype), **metadata}
    check_ascending(config)
    if config.q_lora_rank is None:
        warnings.warn(
            f"q_lora_rank is null: the vLLM plugin's {ARCHITECTURE} serves drafts with a Q-LoRA only (this export is "
            "still re-importable)",
            stacklevel=3,
        )
    # kimi_k2: the DeepSeek-V3 config class vLLM and SGLang parse MLA drafts with (module docstring)
    data: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": ENGINE_MODEL_TYPE, "num_hidden_layers": 1}
    data.update({_json_name(name): getattr(config, name) for name in _PLAIN_FIELDS})
    data["tie_word_embeddings"] = False
    data["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    data.update(aux_fields(config))
    return {**data, **metadata}


def aux_fields(config: Eagle3DraftConfig) -> dict[str, Any]:
    """The aux-id and stream fields both formats write: our 0-based ``aux_layer_ids`` (``fc`` order), the one-based
    engine ids at the top level and in ``eagle_config``, and the engine setting of the stream."""
    engine_ids = [i + 1 for i in config.aux_layer_ids]
    return {
        "aux_layer_ids": list(config.aux_layer_ids),
        AUX_IDS_KEY: engine_ids,
        "eagle_config": {AUX_IDS_KEY: engine_ids, "use_aux_hidden_state": True},
        SERVING_ENV_KEY: {AUX_STREAM_ENV: AUX_STREAM_ENV_VALUE[config.aux_stream]},
    }


def aux_layer_ids_from_json(data: dict[str, Any], legacy_zero_based: bool) -> list[int] | None:
    """Our 0-based ids from an export: ``aux_layer_ids`` when written (checked against the one-based engine ids),
    else the engine key minus one; ``legacy_zero_based`` reads a K3-format export written before the engine key was
    one-based (no ``aux_layer_ids`` field), whose ``eagle_config`` held the 0-based ids."""
    top, nested = data.get(AUX_IDS_KEY), (data.get("eagle_config") or {}).get(AUX_IDS_KEY)
    if top is not None and nested is not None and list(top) != list(nested):
        raise ValueError(f"config.json: {AUX_IDS_KEY} {top} (top level) and eagle_config.{AUX_IDS_KEY} {nested} differ")
    engine = top if top is not None else nested
    ours = data.get("aux_layer_ids")
    if ours is None and engine is not None and legacy_zero_based:
        return list(engine)
    if engine is not None and any(not isinstance(i, int) or isinstance(i, bool) or i < 1 for i in engine):
        raise ValueError(f"{AUX_IDS_KEY} {engine} are not one-based layer ids (all >= 1)")
    if ours is None:
        return None if engine is None else [i - 1 for i in engine]
    if engine is not None and sorted(i + 1 for i in ours) != sorted(engine):
        raise ValueError(f"config.json: aux_layer_ids {ours} (0-based) do not match {AUX_IDS_KEY} {engine} (one-based)")
    return list(ours)


def config_from_json(data: dict[str, Any]) -> Eagle3DraftConfig:
    """Inverse of :func:`config_to_json` (either format)."""
    if data.get("architectures") == [ENGINE_ARCHITECTURE]:
        return engine_config_from_json(data)
    if data.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"not a lightning_eagle K3 draft export: architectures={data.get('architectures')!r}")
    values = {name: data[_json_name(name)] for name in _PLAIN_FIELDS if _json_name(name) in data}
    values["aux_layer_ids"] = aux_layer_ids_from_json(data, legacy_zero_based=True)
    return Eagle3DraftConfig(**values)


# ---- the engine format (deepseek_mla) -------------------------------------------------------------------------------
# config.json fields the engines read, 1:1 with Eagle3DraftConfig: the target-derived fields except the K3 layer's
# (SiTU betas, NoPE, gate; the activation stays, ``silu``), and the draft's own.
_ENGINE_FIELDS = (
    *(name for name in FIELDS_FROM_TARGET if name not in set(DEEPSEEK_MLA_LAYER_VALUES) - {"hidden_act"}),
    *("draft_vocab_size", "target_hidden_size", "rope_theta", "fc_norm", "norm_output"),
)
# Ours only (engines ignore them): what the draft was trained on, for re-import and re-export.
_ENGINE_PROJECT_FIELDS = (
    "aux_stream",
    "target_num_hidden_layers",
    "freeze_embeddings",
    "initializer_range",  # also a field of the engines' DeepseekV3Config (how a fresh model is initialised)
)
DEFAULT_MAX_POSITION_EMBEDDINGS = 4096  # HF DeepseekV3Config's default, used when neither draft nor target says


def check_engine_aux_ids(config: Eagle3DraftConfig) -> None:
    """The export's one check of the aux ids (module docstring): valid taps, our tap ``L`` refused (no engine captures
    it), a warning for tap 0 (SGLang's +1 rule)."""
    ids, L = (
        validate_taps(config.aux_layer_ids, config.target_num_hidden_layers, NUM_AUX_HIDDEN_STATES, why=TAP_REASONS),
        config.target_num_hidden_layers,
    )
    if L is not None and L in ids:
        raise ValueError(
            f"aux_layer_ids {ids} contain L={L} (the pre-norm final state): the engines number aux states by the "
            f"layer they enter (engine id = our id + 1), so it would be engine id {L + 1}, which vLLM never captures "
            f"for a {L}-layer target (a shape error at serving time); train with ids in [0, {L - 1}]"
        )
    if min(ids) == 0:
        warnings.warn(
            f"aux_layer_ids {ids} tap layer 0, i.e. engine id 1: SGLang 0.5.23 adds 1 to every configured id when the "
            "first one is 1 (deepseek_v2.py set_eagle3_layers_to_capture), so SGLang would feed this draft the "
            "states one layer later than it was trained on; vLLM serves it as trained",
            stacklevel=4,
        )


def to_engine_aux_order(
    state: dict[str, torch.Tensor], config: Eagle3DraftConfig
) -> tuple[dict[str, torch.Tensor], Eagle3DraftConfig]:
    """``state`` and ``config`` with the aux ids checked (:func:`check_engine_aux_ids`) and ascending, ``fc``'s input
    chunks and the ``fc_norm`` weights permuted to match: the same function, in the order the engines feed (they sort
    the ids). ``fc`` input chunk ``j`` of the export is our chunk ``order[j]``."""
    check_engine_aux_ids(config)
    ids = config.aux_layer_ids
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if order == sorted(order):
        return state, config
    state = dict(state)
    chunks = state["fc.weight"].chunk(len(order), dim=1)
    state["fc.weight"] = torch.cat([chunks[i] for i in order], dim=1)
    if config.fc_norm:
        norms = [state[f"fc_norm.{i}.weight"] for i in range(len(order))]
        for j, i in enumerate(order):
            state[f"fc_norm.{j}.weight"] = norms[i]
    return state, config.replace(aux_layer_ids=[ids[i] for i in order])


def check_ascending(config: Eagle3DraftConfig) -> None:
    if list(config.aux_layer_ids) != sorted(config.aux_layer_ids):
        raise ValueError(f"aux_layer_ids {config.aux_layer_ids} are not ascending: export through to_engine_aux_order")


def engine_config_to_json(config: Eagle3DraftConfig, torch_dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the engine format (module docstring); ``config``'s aux ids must already be ascending
    (:func:`to_engine_aux_order`)."""
    check_ascending(config)
    if config.rope_scaling is None and config.rope_theta != DEFAULT_ROPE_THETA:
        warnings.warn(
            f"rope_theta={config.rope_theta} without rope_scaling: vLLM's {ENGINE_ARCHITECTURE} rebuilds its rope "
            "parameters from rope_scaling alone (deepseek_eagle3.py: {'rope_type': 'default'}), i.e. base 10000; "
            "check the engine version you serve with",
            stacklevel=3,
        )
    data: dict[str, Any] = {
        "architectures": [ENGINE_ARCHITECTURE],
        "model_type": ENGINE_MODEL_TYPE,
        "num_hidden_layers": 1,
    }
    data.update({name: getattr(config, name) for name in _ENGINE_FIELDS})
    data["max_position_embeddings"] = config.max_position_embeddings or DEFAULT_MAX_POSITION_EMBEDDINGS
    # The theta also inside rope_scaling: vLLM builds its rotary from rope_scaling only (get_rope reads rope_theta).
    data["rope_scaling"] = (
        None if config.rope_scaling is None else {**config.rope_scaling, "rope_theta": config.rope_theta}
    )
    data["tie_word_embeddings"] = False
    data["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    data.update(aux_fields(config))
    data.update({_json_name(name): getattr(config, name) for name in _ENGINE_PROJECT_FIELDS})
    return data


def serving_instructions(config_json: dict[str, Any], folder: str) -> list[str]:
    """What a user must set to serve the export at ``folder`` (printed by ``cli.py export``)."""
    env = config_json.get(SERVING_ENV_KEY) or {}
    prefix = " ".join(f"{k}={v}" for k, v in sorted(env.items()))
    spec = json.dumps({"method": "eagle3", "model": folder, "num_speculative_tokens": 3})
    lines = []
    if config_json.get("architectures") == [ARCHITECTURE]:
        lines.append(
            f"{ARCHITECTURE} (the K3-faithful draft) is served by vLLM with our plugin: "
            'pip install "lightning_eagle[vllm]"'
        )
    return lines + [
        f"engine setting the draft needs: {prefix}" if prefix else "engine setting: none",
        f"serve: {prefix + ' ' if prefix else ''}vllm serve <K3 checkpoint> --speculative-config '{spec}'",
    ]


def engine_config_from_json(data: dict[str, Any]) -> Eagle3DraftConfig:
    """Inverse of :func:`engine_config_to_json`; also reads the public drafts of this format (project fields absent:
    our defaults; aux ids one-based → 0-based)."""
    if data.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{ENGINE_ARCHITECTURE} drafts have one layer, got num_hidden_layers={data['num_hidden_layers']}"
        )
    values: dict[str, Any] = {name: data[name] for name in _ENGINE_FIELDS if name in data}
    values.update({name: data[_json_name(name)] for name in _ENGINE_PROJECT_FIELDS if _json_name(name) in data})
    values.update(architecture="deepseek_mla", mla_use_nope=False, mla_use_output_gate=False)
    values.update(activation_situ_beta=None, activation_situ_linear_beta=None)
    values["hidden_act"] = data.get("hidden_act", "silu")
    values["rope_scaling"] = data.get("rope_scaling")
    values["max_position_embeddings"] = data.get("max_position_embeddings")
    ids = aux_layer_ids_from_json(data, legacy_zero_based=False)
    if ids is not None:
        values["aux_layer_ids"] = ids
        values.setdefault("aux_stream", "prefix")  # what the engines feed by default
    return Eagle3DraftConfig(**values)


def to_serving_names(state: dict[str, torch.Tensor], config: Eagle3DraftConfig) -> dict[str, torch.Tensor]:
    """Our state keys → the export's (the engine format names the layer ``layers.0.``)."""
    if config.architecture != "deepseek_mla":
        return dict(state)
    prefix = "midlayer."
    return {(ENGINE_LAYER_PREFIX + k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in state.items()}


def is_engine_layout(config_json: dict[str, Any]) -> bool:
    return config_json.get("architectures") == [ENGINE_ARCHITECTURE]


def engine_state_to_draft(state: dict[str, torch.Tensor], config: Eagle3DraftConfig) -> dict[str, torch.Tensor]:
    """An engine-format state → our draft's keys: ``layers.0.``/``midlayer.`` → ``midlayer.``; a draft vocabulary
    that is not ascending (foreign exports keep frequency order) is sorted like the reference import; absent
    ``d2t``/``t2d`` (identity vocabulary) are added."""
    out = {}
    for key, value in state.items():
        if key.startswith(ENGINE_LAYER_PREFIX):
            key = "midlayer." + key[len(ENGINE_LAYER_PREFIX) :]
        out[key] = value
    return sort_vocabulary(out, config)


# ---- what every draft read or write checks: finite weights, one consistent snapshot of an export ---------------------
WRITE_ID_KEY = "lightning_eagle_write_id"  # in config.json and in the safetensors metadata of one write
SNAPSHOT_READS = 5  # reads of an export being replaced before the loader gives up
_FINITE_CHUNK = 1 << 24  # elements per isfinite pass: no full-size bool copy of a large tensor


def non_finite_count(tensor: torch.Tensor) -> int:
    """NaN / inf entries of a floating ``tensor`` (0 for other dtypes), counted in chunks."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.device.type == "meta":
        return 0
    flat = tensor.detach().reshape(-1)
    return sum(int((~torch.isfinite(flat[i : i + _FINITE_CHUNK])).sum()) for i in range(0, flat.numel(), _FINITE_CHUNK))


def check_finite(state: dict[str, torch.Tensor], where: str) -> None:
    """Refuse a NaN or inf in any floating tensor of ``state`` (a damaged draft): one ``ValueError`` naming ``where``
    (the file, checkpoint or module) and the tensor. An engine would serve such a draft and acceptance would measure
    it as 1.000, so no export is written or read with one."""
    for key, tensor in state.items():
        bad = non_finite_count(tensor)
        if bad:
            raise ValueError(
                f"{where}: tensor {key!r} holds {bad} non-finite value(s) (NaN/inf) of {tensor.numel()}: the draft's "
                "weights are damaged (a diverged run or a corrupt file); it is neither exported nor loaded"
            )


def new_write_id() -> str:
    """The id one export write records in its ``config.json`` and its safetensors metadata (:func:`read_snapshot`)."""
    return uuid.uuid4().hex


def read_safetensors(file: Path) -> tuple[dict[str, torch.Tensor], str | None]:
    """``(tensors, write id or None)`` of one safetensors file, read through one open (the metadata and the tensors
    are the same file's); a truncated or corrupt file is one ``ValueError`` naming it."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            write_id = (handle.metadata() or {}).get(WRITE_ID_KEY)
            return {key: handle.get_tensor(key) for key in handle.keys()}, write_id  # noqa: SIM118 (not a dict)
    except SafetensorError as err:  # truncated or corrupt: name the file instead of a bare header error
        raise ValueError(f"{file}: cannot read safetensors file, it is truncated or corrupt ({err})") from None


def read_snapshot(
    folder: Path, read_config: Callable[[], dict[str, Any]], read_weights: Callable[[], tuple[dict, set]]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json, tensors)`` of the export at ``folder`` as one write left them.

    A fit's :class:`~lightning_eagle.training.export_callback.ExportDraftCallback` replaces its export folder while a
    reader may be loading it: :func:`~lightning_eagle.atomic.atomic_dir` swaps whole folders, but a reader opens
    ``config.json`` and the weights one after the other, so without a check it can pair one write's config with the
    next write's tensors (and for a moment, between the two renames of the swap, find no folder at all). Every write
    of ours therefore records one fresh id (:func:`new_write_id`) under :data:`WRITE_ID_KEY` in both ``config.json``
    and the safetensors metadata; the reader reads the config, then the weights (``read_weights`` returns the ids its
    files carry), and accepts the pair only when the ids agree, reading again (up to :data:`SNAPSHOT_READS` times, a
    short pause between) when they differ or a file vanished mid-swap. An export without ids (written before them, by
    another tool, or edited by hand) has nothing to compare and is read once, as before."""
    for attempt in range(SNAPSHOT_READS):
        last = attempt == SNAPSHOT_READS - 1
        try:
            config_json = read_config()
            state, weight_ids = read_weights()
        except FileNotFoundError:
            if last:
                raise
            time.sleep(0.02 * (attempt + 1))
            continue
        wanted = config_json.get(WRITE_ID_KEY) if isinstance(config_json, dict) else None
        others = {i for i in weight_ids if i is not None and i != wanted}
        if wanted is None or not others:
            return config_json, state
        if last:
            raise ValueError(
                f"{folder}: {CONFIG_NAME} (write {wanted}) and its weights (write {sorted(others)[0]}) come from "
                f"different writes in {SNAPSHOT_READS} reads: the export is being replaced (a fit exporting into it) "
                "faster than it can be read, or its files were mixed from two exports; read it when the writer is done"
            )
        time.sleep(0.02 * (attempt + 1))
    raise AssertionError("unreachable")
