"""The serving export format of the K3 draft (`eagle3_training.md` §14): the exact key set with shapes and dtypes,
and the ``config.json`` fields, in both directions. Writing is :mod:`lightning_eagle.draft.export`; reading is
:mod:`lightning_eagle.draft.pretrained`.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_eagle.draft.config import FIELDS_FROM_TARGET, NUM_AUX_HIDDEN_STATES, Eagle3DraftConfig

ARCHITECTURE = "Eagle3KimiK3ForCausalLM"  # §14.2 decision: engines must refuse it loudly until a K3 head exists
MODEL_TYPE = "kimi_linear"
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
    """Every export key → (shape, dtype or ``FLOAT``); nothing else may be written."""
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
    if c.mla_use_output_gate:
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


def config_to_json(config: Eagle3DraftConfig, torch_dtype: torch.dtype) -> dict[str, Any]:
    """The §14.2 ``config.json``. Refuses a draft whose aux ids are unknown: engines cannot serve it correctly."""
    if config.aux_layer_ids is None or config.aux_hidden_state_stream is None:
        raise ValueError(
            "the draft config does not record which target aux states it was trained on (aux_layer_ids / "
            "aux_hidden_state_stream are None, e.g. a draft imported from a reference export); pass aux_layer_ids= "
            "and aux_hidden_state_stream= to export_draft"
        )
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
    """Inverse of :func:`config_to_json`."""
    if data.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"not a lightning_eagle K3 draft export: architectures={data.get('architectures')!r}")
    values = {name: data[name] for name in _PLAIN_FIELDS if name in data}
    values["aux_layer_ids"] = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3DraftConfig(**values)
