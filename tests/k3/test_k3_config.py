import json

import pytest
from transformers import AutoConfig

from lightning_eagle import KimiK3Config, KimiK3TextConfig
from lightning_eagle.k3.config import default_full_attn_layers, text_config_from_dict
from lightning_eagle.k3.presets import PRESETS, config_from_name


def test_published_defaults_and_layer_pattern():
    cfg = KimiK3TextConfig()
    assert cfg.model_type == "kimi_linear"
    assert (cfg.num_attention_heads, cfg.intermediate_size, cfg.num_hidden_layers) == (96, 33792, 93)
    assert len(cfg.kda_layers) == 69 and len(cfg.full_attn_layers) == 24
    assert cfg.full_attn_layers == list(range(4, 93, 4)) + [93]
    assert [i for i in range(93) if not cfg.is_kda(i)][-2:] == [91, 92]  # the only adjacent MLA pair
    assert not cfg.is_moe(0) and all(cfg.is_moe(i) for i in range(1, 93))
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (163584, 163586, 163839)
    assert config_from_name("k3").to_dict() == cfg.to_dict()


def test_default_generator_appends_last_layer():
    assert default_full_attn_layers(93)[-2:] == [92, 93]
    assert default_full_attn_layers(8) == [4, 8]
    assert default_full_attn_layers(5) == [4, 5]


@pytest.mark.parametrize(
    "lists, fragment",
    [
        ({"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 5, 6]}, "in both"),
        ({"kda_layers": [1, 2, 3], "full_attn_layers": [4, 6]}, "missing layers [5]"),
        ({"kda_layers": [1, 2, 3, 5, 7], "full_attn_layers": [4, 6]}, "out of range: [7]"),
        ({"kda_layers": [0, 1, 2, 3, 5], "full_attn_layers": [4, 6]}, "out of range: [0]"),
    ],
)
def test_layer_lists_must_partition(lists, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        config_from_name("k3-tiny", linear_attn_config=lists)


def test_truncation_filters_instead_of_regenerating():
    cfg = config_from_name("k3-tiny", num_hidden_layers=5)
    assert (cfg.kda_layers, cfg.full_attn_layers) == ([1, 2, 3, 5], [4])
    trailing = config_from_name("k3-tiny-trailing-mla")
    assert (trailing.kda_layers, trailing.full_attn_layers) == ([1, 2, 3], [4, 5])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"hidden_act": "gelu"}, "unknown hidden_act 'gelu'"),
        ({"num_experts_per_token": 9}, r"num_experts_per_token \(9\) must be in \[1, num_experts=8\]"),
        ({"num_key_value_heads": 2}, "one K/V head per query head"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"num_expert_group": 3}, r"num_expert_group \(3\) must divide num_experts \(8\)"),
        ({"topk_method": "greedy"}, "noaux_tc"),
        ({"moe_router_activation_func": "relu"}, "moe_router_activation_func"),
        ({"attn_res_block_size": 0}, "attn_res_block_size"),
        (
            {"routed_expert_hidden_size": 48, "quantization_config": {"format": "mxfp4-pack-quantized"}},
            "divisible by 32: routed_expert_hidden_size=48",
        ),
    ],
)
def test_validation_messages(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        config_from_name("k3-tiny", **overrides)


def test_every_preset_builds():
    for name in PRESETS:
        assert config_from_name(name).model_type == "kimi_linear"
    with pytest.raises(ValueError, match="unknown K3 preset 'nope'"):
        config_from_name("nope")


def test_outer_config_extraction_and_token_ids(golden_dir):
    data = json.loads((golden_dir / "target" / "config.json").read_text())
    text = text_config_from_dict(data)
    assert text.model_type == "kimi_linear" and text.num_hidden_layers == 8
    assert (text.bos_token_id, text.eos_token_id, text.pad_token_id) == (256, 258, 511)
    stripped = dict(data, text_config={k: v for k, v in data["text_config"].items() if not k.endswith("token_id")})
    assert text_config_from_dict(stripped).pad_token_id == 511  # copied from the outer config
    assert text.experts_are_mxfp4
    with pytest.raises(ValueError, match="kimi_linear"):
        text_config_from_dict(dict(data["text_config"], model_type="kimi_k3"))


def test_autoconfig_without_remote_code(golden_dir):
    cfg = AutoConfig.from_pretrained(golden_dir / "target", trust_remote_code=False)
    assert isinstance(cfg, KimiK3Config)
    assert isinstance(cfg.text_config, KimiK3TextConfig)
    assert cfg.text_config.full_attn_layers == [4, 8]
    assert isinstance(cfg.vision_config, dict)


def test_unknown_runtime_knobs_are_accepted():
    cfg = config_from_name("k3-tiny", kda_mode="chunk", situ_backend="triton")
    assert cfg.kda_mode == "chunk"
