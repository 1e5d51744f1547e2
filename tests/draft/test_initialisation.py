"""The drafts' initial weights are the reference trainers' (SpecForge for EAGLE-3, DeepSpec for DSpark: Hugging Face's
``_init_weights``): every trained Linear / Embedding weight N(0, ``initializer_range``), biases 0, norm gains 1, made
by :func:`~lightning_eagle.draft.materialize.materialize` from ``(seed, parameter name)`` only."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_eagle.draft import build_draft
from lightning_eagle.draft.dspark import DSparkDrafter
from lightning_eagle.draft.dspark_config import DSparkDraftConfig, dspark_config_from_preset
from lightning_eagle.draft.dspark_export import dspark_config_from_json, dspark_config_json
from lightning_eagle.draft.materialize import build_on_meta, materialize
from lightning_eagle.draft.serving_format import config_from_json, config_to_json
from tests.draft_helpers import tiny_config

FROZEN = "embed_tokens.weight"  # EAGLE-3's copy of the target's embedding: skipped, copied from the target later


def eagle3(architecture: str, **overrides) -> nn.Module:
    return build_draft(tiny_config(architecture=architecture, fc_norm=True, **overrides))


def dspark(**overrides) -> nn.Module:
    return DSparkDrafter(dspark_config_from_preset("k3-tiny", **overrides))


FAMILIES = {
    "eagle3-k3": lambda **o: eagle3("k3", **o),
    "eagle3-deepseek_mla": lambda **o: eagle3("deepseek_mla", **o),
    "dspark": dspark,
}


def materialized(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    return materialize(build_on_meta(lambda: FAMILIES[family](**overrides)), "cpu", dtype, seed, skip=[FROZEN])


def trained_parameters(draft: nn.Module):
    """``(name, module, parameter name, parameter)`` of every initialised parameter."""
    for prefix, module in draft.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}".lstrip(".")
            if full != FROZEN:
                yield full, module, name, p


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("std", [None, 0.05])
def test_linear_and_embedding_weights_are_normal_biases_zero_norms_one(family, std):
    draft = materialized(family, **({} if std is None else {"initializer_range": std}))
    std = draft.config.initializer_range if std is None else std
    assert draft.config.initializer_range == std and (std == 0.05 or std == 0.02)
    seen = {"weight": 0, "bias": 0, "norm": 0}
    for full, module, name, p in trained_parameters(draft):
        if isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight":
            n = p.numel()  # the sample mean and std of n normals: errors ~ std/sqrt(n), std/sqrt(2n); 6 sigmas
            assert abs(p.mean().item()) < 6 * std / math.sqrt(n), full
            assert abs(p.std().item() - std) < 6 * std / math.sqrt(2 * n), full
            seen["weight"] += 1
        elif name == "bias":
            assert torch.equal(p, torch.zeros_like(p)), full
            seen["bias"] += 1
        else:  # the norms' gains
            assert "norm" in full and name == "weight", full
            assert torch.equal(p, torch.ones_like(p)), full
            seen["norm"] += 1
    assert seen["weight"] >= 7 and seen["norm"] >= 3
    assert seen["bias"] == (1 if family == "dspark" else 0)  # the confidence head's


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_initial_values_depend_only_on_seed_and_name(family):
    a, b, c = materialized(family), materialized(family), materialized(family, seed=1)
    half = materialized(family, dtype=torch.bfloat16)
    for (name, _, _, p), (_, _, _, q), (_, _, _, r), (_, _, _, h) in zip(
        *(trained_parameters(d) for d in (a, b, c, half)), strict=True
    ):
        assert torch.equal(p, q), name
        assert torch.equal(p.to(torch.bfloat16), h), name  # initialised in fp32, then cast
        if p.numel() > 1 and p.std() > 0:  # random tensors (not the constant norms and biases) follow the seed
            assert not torch.equal(p, r), name


@pytest.mark.parametrize("family", ["eagle3-k3", "eagle3-deepseek_mla"])
def test_the_frozen_embedding_is_skipped(family):
    """``materialize`` never initialises the embedding EAGLE-3 copies from the target; every other module with
    parameters goes through the draft's ``init_module``."""
    draft = build_on_meta(lambda: FAMILIES[family]())
    initialised = []
    rule = draft.init_module
    draft.init_module = lambda module: (initialised.append(module), rule(module))
    materialize(draft, "cpu", torch.float32, 0, skip=[FROZEN])
    holders = [m for m in draft.modules() if any(True for _ in m.parameters(recurse=False))]
    assert draft.embed_tokens not in initialised
    assert {id(m) for m in initialised} == {id(m) for m in holders if m is not draft.embed_tokens}


@torch.no_grad()
def test_the_dspark_markov_bias_starts_small():
    """The Markov bias ``markov_w2(markov_w1[x])`` over every (previous token, next token) pair has std
    ``initializer_range² · sqrt(r)`` (PyTorch's defaults, W1 N(0, 1) and W2 Kaiming-uniform, gave 1/sqrt(3) ≈ 0.58
    logit whatever r)."""
    drafter = materialized("dspark")
    std, r = drafter.config.initializer_range, drafter.config.markov_rank
    bias = drafter.markov_head.bias(torch.arange(drafter.config.vocab_size))  # [V, V]
    expected = std * std * math.sqrt(r)  # 0.0023 for k3-tiny's r = 32; 0.0064 for K3's r = 256
    assert abs(bias.std().item() - expected) < 0.05 * expected
    assert bias.abs().max().item() < 8 * expected


@pytest.mark.parametrize("bad", [0, -0.02, float("nan"), float("inf"), True, "0.02"])
def test_configs_refuse_a_bad_initializer_range(bad):
    with pytest.raises(ValueError, match="initializer_range must be a positive finite number"):
        tiny_config(initializer_range=bad)
    with pytest.raises(ValueError, match="initializer_range must be a positive finite number"):
        dspark_config_from_preset("k3-tiny", initializer_range=bad)


@pytest.mark.parametrize("architecture", ["k3", "deepseek_mla"])
def test_the_eagle3_export_round_trips_initializer_range(architecture):
    config = tiny_config(architecture=architecture, initializer_range=0.01)
    data = config_to_json(config, torch.bfloat16)
    assert data["initializer_range"] == 0.01
    assert config_from_json(data) == config


def test_the_dspark_export_and_checkpoint_round_trip_initializer_range():
    config = dspark_config_from_preset("k3-tiny", initializer_range=0.01)
    data = dspark_config_json(config, torch.bfloat16)
    assert data["initializer_range"] == 0.01
    assert dspark_config_from_json(data) == config
    assert DSparkDraftConfig.from_dict(config.to_dict()) == config
