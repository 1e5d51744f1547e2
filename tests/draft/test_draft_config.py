"""Draft config: derivation from the target, overrides, §3.6 rejections, aux-id validation, published size (§3.7)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_eagle.draft import Eagle3DraftConfig, KimiK3Eagle3Draft
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.presets import config_from_name


def test_fields_default_to_the_target(make_config):
    target = config_from_name("k3-tiny")
    cfg = make_config()
    for name in (
        "hidden_size",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "vocab_size",
        "activation_situ_beta",
        "activation_situ_linear_beta",
        "pad_token_id",
    ):
        assert getattr(cfg, name) == getattr(target, name), name
    assert cfg.target_hidden_size == target.hidden_size
    assert cfg.target_num_hidden_layers == target.num_hidden_layers
    assert cfg.aux_stream == "prefix"
    assert cfg.freeze_embeddings is True


def test_draft_dims_are_overridable(make_config):
    cfg = make_config(num_attention_heads=2, intermediate_size=64, hidden_size=96)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (2, 2, 64)
    assert (cfg.hidden_size, cfg.target_hidden_size) == (96, 128)  # fc still reads 3 × the target's width
    draft = KimiK3Eagle3Draft(cfg)
    assert draft.fc.weight.shape == (96, 3 * 128)


def test_published_defaults():
    cfg = Eagle3DraftConfig.from_target_config(KimiK3TextConfig())
    assert cfg.draft_vocab_size == 32000 and cfg.vocab_size == 163840
    assert cfg.aux_layer_ids == [1, 45, 89]
    assert (cfg.num_attention_heads, cfg.intermediate_size) == (96, 33792)
    # V <= 32000: identity map
    assert (
        Eagle3DraftConfig.from_target_config(config_from_name("k3-tiny"), aux_layer_ids=[1, 3, 5]).draft_vocab_size
        == 256
    )


def test_tiny_default_aux_ids_collide():
    with pytest.raises(ValueError, match="pass aux_layer_ids explicitly"):
        Eagle3DraftConfig.from_target_config(config_from_name("k3-tiny"))  # L=6 → [1, 2, 2]


@pytest.mark.parametrize(
    "ids, fragment", [([1, 3], "exactly 3"), ([1, 3, 3], "distinct"), ([1, 3, 7], "outside"), ([-1, 3, 5], "outside")]
)
def test_aux_id_validation(make_config, ids, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_config(aux_layer_ids=ids)


def test_gqa_rejected_by_config_and_constructor(make_config):
    with pytest.raises(ValueError, match="one K/V head per query head"):
        make_config(num_key_value_heads=2)
    # KimiK3TextConfig itself refuses GQA, so feed from_target_config a plain attribute bag.
    target = SimpleNamespace(**{**config_from_name("k3-tiny").to_dict(), "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="one K/V head per query head"):
        Eagle3DraftConfig.from_target_config(target, aux_layer_ids=[1, 3, 5])
    cfg = make_config()
    cfg.num_key_value_heads = 1  # a hand-edited config must still be refused by the draft constructor (§3.6)
    with pytest.raises(ValueError, match="one K/V head per query head"):
        KimiK3Eagle3Draft(cfg)


def test_rope_rotation_rejected(make_config):
    with pytest.raises(ValueError, match="mla_use_nope"):
        make_config(mla_use_nope=False)
    cfg = make_config()
    cfg.mla_use_nope = False
    with pytest.raises(ValueError, match="mla_use_nope"):
        KimiK3Eagle3Draft(cfg)


def test_unknown_override_and_dict_round_trip(make_config):
    with pytest.raises(TypeError, match="unknown"):
        make_config(not_a_field=1)
    cfg = make_config(fc_norm=True, norm_output=True)
    assert Eagle3DraftConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        Eagle3DraftConfig.from_dict({**cfg.to_dict(), "bogus": 1}, strict=True)


def test_published_size_matches_spec():
    """§3.7: ≈ 1.45 B trainable + 1.17 B frozen embedding with the published dims (built on meta, no memory)."""
    with torch.device("meta"):
        draft = KimiK3Eagle3Draft(Eagle3DraftConfig.from_target_config(KimiK3TextConfig()))
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    assert frozen == 163840 * 7168
    assert 1.44e9 < trainable < 1.46e9, trainable
    assert draft.fc.weight.numel() == 7168 * 21504 and draft.lm_head.weight.shape == (32000, 7168)
