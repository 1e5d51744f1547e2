"""The serving export formats of the draft (`eagle3_training.md` §14): the exact key set with shapes and dtypes, and
the ``config.json`` fields, in both directions. Writing is :mod:`lightning_eagle.draft.export`; reading is
:mod:`lightning_eagle.draft.pretrained`.

Two formats, one per draft architecture:

* ``architecture="k3"`` → ``Eagle3KimiK3ForCausalLM`` (§14.2): our layout (``midlayer.*``), 0-based aux ids; no
  engine has this class, so engines refuse it loudly instead of silently serving the gated SiTU layer wrong.
* ``architecture="deepseek_mla"`` → ``Eagle3DeepseekV2ForCausalLM`` (``model_type "deepseek_v3"``): exactly what
  SGLang (``python/sglang/srt/models/kimi_k25_eagle3.py``) and vLLM (``vllm/model_executor/models/
  deepseek_eagle3.py``) load. Weights ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (and
  ``embed_tokens`` only when trained); unfused ``q_a_proj`` / ``kv_a_proj_with_mqa`` and ``gate_proj`` / ``up_proj``
  (the loaders fuse them); ``d2t`` = target id − draft id (both loaders add ``arange``), ``t2d`` written for our
  re-import and ignored by both. ``eagle_config.eagle_aux_hidden_state_layer_ids`` is **one-based** (the engines'
  numbering of the hidden state entering layer i: our 0-based K3 taps ``[1, 45, 89]`` are ``[2, 46, 90]``).

Aux stream requirement of the engine format: the engines feed the draft the hidden states their target model
captures — the *prefix* stream (the raw per-layer output, `k3_target.md` §6.3), never the AttnRes ``"mixed"``
stream — so only a draft trained on ``aux_hidden_state_stream="prefix"`` is exported under the engine name.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_eagle.draft.config import (
    DEFAULT_ROPE_THETA,
    FIELDS_FROM_TARGET,
    NUM_AUX_HIDDEN_STATES,
    Eagle3DraftConfig,
)
from lightning_eagle.draft.reference_import import sort_vocabulary

ARCHITECTURE = "Eagle3KimiK3ForCausalLM"  # §14.2 decision: engines must refuse it loudly until a K3 head exists
MODEL_TYPE = "kimi_linear"
ENGINE_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # SGLang and vLLM (vLLM also aliases Eagle3DeepseekV3ForCausalLM)
ENGINE_MODEL_TYPE = "deepseek_v3"
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
    "aux_hidden_state_stream",
    "step_decay",
    "ttt_steps",
    "target_num_hidden_layers",
    "freeze_embeddings",
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


def check_state(state: dict[str, torch.Tensor], config: Eagle3DraftConfig, include_embeddings: bool) -> torch.dtype:
    """Refuse anything but the exact key set (shapes, dtypes, no trainer prefixes); returns the float dtype."""
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


def config_to_json(config: Eagle3DraftConfig, torch_dtype: torch.dtype) -> dict[str, Any]:
    """The export's ``config.json`` (§14.2, or the engine format for deepseek_mla). Refuses a draft whose aux ids are
    unknown: engines cannot serve it correctly."""
    if config.aux_layer_ids is None or config.aux_hidden_state_stream is None:
        raise ValueError(
            "the draft config does not record which target aux states it was trained on (aux_layer_ids / "
            "aux_hidden_state_stream are None, e.g. a draft imported from a reference export); pass aux_layer_ids= "
            "and aux_hidden_state_stream= to export_draft"
        )
    if config.architecture == "deepseek_mla":
        return engine_config_to_json(config, torch_dtype)
    data: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "num_hidden_layers": 1}
    data.update({name: getattr(config, name) for name in _PLAIN_FIELDS})
    data["tie_word_embeddings"] = False
    data["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    data["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "use_aux_hidden_state": True,
    }
    return data


def config_from_json(data: dict[str, Any]) -> Eagle3DraftConfig:
    """Inverse of :func:`config_to_json` (either format)."""
    if data.get("architectures") == [ENGINE_ARCHITECTURE]:
        return engine_config_from_json(data)
    if data.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"not a lightning_eagle K3 draft export: architectures={data.get('architectures')!r}")
    values = {name: data[name] for name in _PLAIN_FIELDS if name in data}
    values["aux_layer_ids"] = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3DraftConfig(**values)


# ---- the engine format (deepseek_mla) -------------------------------------------------------------------------------
# config.json fields the engines read, 1:1 with Eagle3DraftConfig.
_ENGINE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "rope_theta",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "fc_norm",
    "norm_output",
)
# Ours only (engines ignore them): what the draft was trained on, for re-import and re-export.
_ENGINE_PROJECT_FIELDS = (
    "aux_hidden_state_stream",
    "step_decay",
    "ttt_steps",
    "target_num_hidden_layers",
    "freeze_embeddings",
)
DEFAULT_MAX_POSITION_EMBEDDINGS = 4096  # HF DeepseekV3Config's default, used when neither draft nor target says


def engine_config_to_json(config: Eagle3DraftConfig, torch_dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the engine format (module docstring). Refuses what the engines would serve differently."""
    if config.aux_hidden_state_stream != "prefix":
        raise ValueError(
            f"the draft was trained on the {config.aux_hidden_state_stream!r} aux stream, but SGLang and vLLM feed "
            f"{ENGINE_ARCHITECTURE} the target's prefix stream (each tapped layer's raw output); only a draft "
            "trained with aux_stream: prefix can be exported for them"
        )
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
    data["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config.aux_layer_ids],  # one-based, module docstring
        "use_aux_hidden_state": True,
    }
    data.update({name: getattr(config, name) for name in _ENGINE_PROJECT_FIELDS})
    return data


def engine_config_from_json(data: dict[str, Any]) -> Eagle3DraftConfig:
    """Inverse of :func:`engine_config_to_json`; also reads the public drafts of this format (project fields absent:
    our defaults; aux ids one-based → 0-based)."""
    if data.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{ENGINE_ARCHITECTURE} drafts have one layer, got num_hidden_layers={data['num_hidden_layers']}"
        )
    values: dict[str, Any] = {name: data[name] for name in _ENGINE_FIELDS if name in data}
    values.update({name: data[name] for name in _ENGINE_PROJECT_FIELDS if name in data})
    values.update(architecture="deepseek_mla", mla_use_nope=False, mla_use_output_gate=False)
    values.update(activation_situ_beta=None, activation_situ_linear_beta=None)
    values["hidden_act"] = data.get("hidden_act", "silu")
    values["rope_scaling"] = data.get("rope_scaling")
    values["max_position_embeddings"] = data.get("max_position_embeddings")
    ids = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = data.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 1 for i in ids):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {ids} are not one-based layer ids (all >= 1)")
        values["aux_layer_ids"] = [i - 1 for i in ids]
        values.setdefault("aux_hidden_state_stream", "prefix")  # what the engines feed
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
