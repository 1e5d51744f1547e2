"""The DSpark draft config: vLLM's refusals at construction, one clear error each; the presets match their targets."""

from __future__ import annotations

import json

import pytest

from lightning_eagle.draft.dspark_config import DSPARK_PRESETS, DSparkDraftConfig, dspark_config_from_preset
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.loader import QUICKSTART_TARGET


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"q_lora_rank": None}, "q_lora_rank is required"),
        ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive int"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
        ({"hidden_act": "situ"}, "hidden_act must be 'silu'"),
        ({"mask_token_id": 512}, r"mask_token_id must be a token id in \[0, 512\)"),
        ({"aux_layer_ids": []}, "expected at least one id: vLLM: 'MLA DSpark requires non-empty target_layer_ids'"),
        ({"aux_layer_ids": [3, 1, 4]}, "ids must be ascending: vLLM sorts and de-duplicates"),
        ({"aux_layer_ids": [1, 1, 4]}, "ids must be distinct"),
        ({"aux_layer_ids": [-1, 3]}, r"ids must be in \[0, 5\].*outside: \[-1\]"),
        (
            {"aux_layer_ids": [1, 3, 6]},
            r"ids must be in \[0, 5\] \(num_hidden_layers=6; 6, the pre-norm final state, is not a tap",
        ),
        ({"aux_stream": "mix"}, "aux_stream must be one of"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type 'linear' is not supported"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a positive finite number"),
        ({"enable_confidence_head": 1}, "enable_confidence_head must be a bool"),
    ],
)
def test_config_refuses(overrides, message):
    with pytest.raises(ValueError, match=message):
        dspark_config_from_preset("k3-tiny", **overrides)


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="unknown DSpark draft preset 'k4'"):
        dspark_config_from_preset("k4")
    with pytest.raises(ValueError, match=r"unknown fields \['mla_use_nope'\]"):
        DSparkDraftConfig.from_dict({**DSPARK_PRESETS["k3-tiny"], "mla_use_nope": True})


def test_derived_fields_and_round_trip():
    config = dspark_config_from_preset("k3-tiny")
    assert config.num_target_layers == len(config.aux_layer_ids)
    assert config.context_size == len(config.aux_layer_ids) * config.target_hidden_size
    assert config.engine_aux_layer_ids == [i + 1 for i in config.aux_layer_ids]
    assert DSparkDraftConfig.from_dict(config.to_dict()) == config


def test_tiny_preset_fits_the_quickstart_target():
    text = json.loads((QUICKSTART_TARGET / "config.json").read_text())["text_config"]
    config = dspark_config_from_preset("k3-tiny")
    assert (config.vocab_size, config.target_hidden_size) == (text["vocab_size"], text["hidden_size"])
    assert config.target_num_hidden_layers == text["num_hidden_layers"]
    assert config.mask_token_id not in (text["bos_token_id"], text["eos_token_id"], text["pad_token_id"])


def test_k3_preset_fits_the_real_target():
    target = KimiK3TextConfig()
    config = dspark_config_from_preset("k3")
    assert (config.vocab_size, config.target_hidden_size) == (target.vocab_size, target.hidden_size)
    assert config.target_num_hidden_layers == target.num_hidden_layers
    assert (config.num_hidden_layers, config.num_target_layers, config.block_size) == (5, 5, 7)
    assert (config.q_lora_rank, config.kv_lora_rank) == (1536, 512)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (128, 64, 128)
    assert config.rope_scaling["factor"] == 32 and config.rope_scaling["original_max_position_embeddings"] == 32768
    assert config.rope_theta == 50000
