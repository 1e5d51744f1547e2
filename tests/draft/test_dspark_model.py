"""The DSpark drafter: shapes and names, the chunked forward against the one-shot twin (forward and backward), the
attention visibility, the inference cache against the training forward, and Markov sampling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_eagle.draft.dspark import DSparkContextCache, DSparkDrafter
from lightning_eagle.draft.dspark_config import dspark_config_from_preset

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7, "mscale_all_dim": 1.0}


def build(seed: int = 0, kv_cache: str = "latent", **overrides) -> tuple[DSparkDrafter, nn.Embedding, nn.Linear]:
    torch.manual_seed(seed)
    config = dspark_config_from_preset("k3-tiny", rope_scaling=YARN, **overrides)
    drafter = DSparkDrafter(config, kv_cache=kv_cache)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # norms at 1 would hide a missing or misplaced weight
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return drafter, embed, lm_head


def batch(config, B: int = 2, T: int = 24, A: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(B, T, config.context_size, generator=g)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=g)
    anchors = torch.stack([torch.randperm(T - config.block_size, generator=g)[:A].sort().values for _ in range(B)])
    keep = torch.ones(B, A, dtype=torch.bool)
    keep[-1, -2:] = B > 1  # padded anchors in the last row when there are two rows
    return features, ids, anchors, keep


def test_parameter_shapes_and_count():
    drafter, _, _ = build()
    c = drafter.config
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert shapes["context_proj.weight"] == (c.hidden_size, c.num_target_layers * c.target_hidden_size)
    assert shapes["layers.0.self_attn.q_a_proj.weight"] == (c.q_lora_rank, c.hidden_size)
    assert shapes["layers.0.self_attn.q_b_proj.weight"] == (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank)
    assert shapes["layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (
        c.kv_lora_rank + c.qk_rope_head_dim,
        c.hidden_size,
    )
    kv_b = (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    assert shapes["layers.1.self_attn.kv_b_proj.weight"] == kv_b
    assert (
        shapes["markov_head.markov_w1.weight"]
        == shapes["markov_head.markov_w2.weight"]
        == (c.vocab_size, c.markov_rank)
    )
    assert shapes["confidence_head.proj.weight"] == (1, c.hidden_size + c.markov_rank)
    assert not any("embed" in k or "lm_head" in k for k in shapes)
    H, n = c.hidden_size, c.num_attention_heads
    attention = (
        H * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * c.qk_head_dim
        + H * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank + kv_b[0] * kv_b[1] + n * c.v_head_dim * H
    )  # fmt: skip
    layer = attention + 3 * H * c.intermediate_size + 2 * H
    heads = 2 * c.vocab_size * c.markov_rank + (H + c.markov_rank + 1)
    expected = c.context_size * H + H + c.num_hidden_layers * layer + H + heads
    assert sum(p.numel() for p in drafter.parameters()) == expected
    without = DSparkDrafter(c.replace(enable_confidence_head=False))
    assert "confidence_head.proj.weight" not in without.state_dict()


def forward_and_grads(drafter, embed, features, ids, anchors, keep):
    drafter.zero_grad()
    f = features.clone().requires_grad_(True)
    out = drafter(f, ids, anchors, keep, embed)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    return out.detach(), f.grad, {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}


def assert_same(result, reference, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(result[0], reference[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(result[1], reference[1], rtol=rtol, atol=atol)
    assert set(result[2]) == set(reference[2])
    for k in reference[2]:
        torch.testing.assert_close(result[2][k], reference[2][k], rtol=10 * rtol, atol=atol, msg=k)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_latent_form_equals_expanded_form_forward_and_backward(backend):
    drafter, embed, _ = build()
    drafter.mla_backend = backend
    inputs = batch(drafter.config)
    drafter.kv_cache = "expanded"
    expanded = forward_and_grads(drafter, embed, *inputs)
    drafter.kv_cache = "latent"
    assert_same(forward_and_grads(drafter, embed, *inputs), expanded)


@pytest.mark.parametrize("kv_cache", ["latent", "expanded"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_chunked_equals_one_shot_forward_and_backward(backend, kv_cache):
    drafter, embed, _ = build(kv_cache=kv_cache)
    drafter.mla_backend = backend
    inputs = batch(drafter.config)
    _, _, _, keep = inputs
    drafter.block_chunk = None  # the plain twin: every anchor in one attention call, one dense mask
    plain = forward_and_grads(drafter, embed, *inputs)
    backbone = {k for k, _ in drafter.named_parameters() if not k.startswith(("markov_head.", "confidence_head."))}
    assert plain[0].abs().sum() > 0 and set(plain[2]) == backbone  # the heads are not part of the slot states
    assert (plain[0][~keep] == 0).all()
    for chunk in (2, 4):
        drafter.block_chunk = chunk
        assert_same(forward_and_grads(drafter, embed, *inputs), plain)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_activation_checkpointing_equals_keeping_every_activation_forward_and_backward(backend):
    drafter, embed, _ = build()
    drafter.mla_backend, drafter.block_chunk = backend, 2
    inputs = batch(drafter.config)
    shapes: dict[bool, list[tuple[int, ...]]] = {}
    results = {}
    for recompute in (False, True):  # what autograd holds after the forward, with and without recomputation
        drafter.activation_checkpointing, shapes[recompute] = recompute, []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, s=shapes[recompute]: s.append(t.shape) or t, lambda t: t
        ):
            results[recompute] = forward_and_grads(drafter, embed, *inputs)
    assert_same(results[True], results[False])
    per_head = [s for s in shapes[True] if len(s) == 4 and s[1] == drafter.config.num_attention_heads]
    assert any(len(s) == 4 and s[1] == drafter.config.num_attention_heads for s in shapes[False]) and not per_head
    assert sum(map(math.prod, shapes[True])) < sum(map(math.prod, shapes[False])) / 2


@pytest.mark.parametrize("kv_cache", ["latent", "expanded"])
def test_eager_and_sdpa_agree(kv_cache):
    drafter, embed, _ = build(kv_cache=kv_cache)
    inputs = batch(drafter.config)
    drafter.mla_backend = "eager"
    eager = forward_and_grads(drafter, embed, *inputs)
    drafter.mla_backend = "sdpa"
    assert_same(forward_and_grads(drafter, embed, *inputs), eager)


def test_context_at_or_after_the_anchor_is_not_seen():
    drafter, embed, _ = build()
    features, ids, anchors, keep = batch(drafter.config, B=1, A=3)
    anchors = torch.tensor([[5, 9, 14]])
    keep = torch.ones(1, 3, dtype=torch.bool)
    base = drafter(features, ids, anchors, keep, embed)
    later = features.clone()
    later[:, 9:] = torch.randn_like(later[:, 9:])  # context positions >= 9 (the second anchor)
    ids_later = ids.clone()
    ids_later[:, 10:] = (ids[:, 10:] + 1) % drafter.config.vocab_size  # tokens after the second anchor
    moved = drafter(later, ids_later, anchors, keep, embed)
    torch.testing.assert_close(moved[:, :2], base[:, :2], rtol=0, atol=0)  # anchors 5 and 9 see positions < 9 only
    assert (moved[:, 2] - base[:, 2]).abs().max() > 1e-3  # anchor 14 sees positions 9..13
    earlier = features.clone()
    earlier[:, 8] += 1.0  # position 8 < 9: the second block must see it, the first (anchor 5) must not
    moved = drafter(earlier, ids, anchors, keep, embed)
    torch.testing.assert_close(moved[:, 0], base[:, 0], rtol=0, atol=0)
    assert (moved[:, 1] - base[:, 1]).abs().max() > 1e-3


def test_in_block_attention_is_bidirectional_and_blocks_are_separate():
    drafter, embed, _ = build()
    c = drafter.config
    features, ids, _, _ = batch(c, B=1)
    anchors = torch.tensor([[4, 11]])
    positions = torch.arange(ids.shape[1])
    context = drafter.context_kv(features, positions)
    x = drafter.block_inputs(ids, anchors, embed).detach()
    base = drafter.run_blocks(x, anchors, context, positions)
    last = x.clone()
    last[0, 0, -1] += torch.randn(c.hidden_size)  # the last slot's input of the first block
    moved = drafter.run_blocks(last, anchors, context, positions)
    assert (moved[0, 0, 0] - base[0, 0, 0]).abs().max() > 1e-3  # slot 0 sees slot g-1: bidirectional
    torch.testing.assert_close(moved[0, 1], base[0, 1], rtol=0, atol=0)  # the other block does not


def test_propose_block_with_the_cache_equals_the_training_forward():
    drafter, embed, _ = build()
    features, ids, _, _ = batch(drafter.config)
    anchors = torch.tensor([[9], [9]])
    trained = drafter(features, ids, anchors, torch.ones(2, 1, dtype=torch.bool), embed)[:, 0]
    cache = DSparkContextCache(drafter)
    cache.append(features[:, :4])
    cache.append(features[:, 4:12])  # three positions too many: a rejected tail
    cache.crop(9)
    proposed = drafter.propose_block(cache, ids[:, 9], embed)
    torch.testing.assert_close(proposed, trained, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"crop length must be in \[0, 9\]"):
        cache.crop(10)
    with pytest.raises(ValueError, match="needs target states in the cache"):
        drafter.propose_block(DSparkContextCache(drafter), ids[:, 0], embed)


def test_markov_sampling_greedy_and_temperature():
    drafter, embed, lm_head = build()
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 2.0)  # a bias strong enough to change the argmax
    features, ids, _, _ = batch(drafter.config)
    cache = DSparkContextCache(drafter)
    cache.append(features[:, :10])
    hidden = drafter.propose_block(cache, ids[:, 10], embed)
    greedy = drafter.sample_block(hidden, ids[:, 10], lm_head)
    prev = torch.cat([ids[:, 10:11], greedy.tokens[:, :-1]], dim=1)
    logits = lm_head(hidden) + drafter.markov_bias(prev)
    assert torch.equal(greedy.tokens, logits.argmax(-1))
    torch.testing.assert_close(greedy.logits, logits, rtol=1e-5, atol=1e-5)  # the slots' logits, untempered
    assert not torch.equal(greedy.tokens, lm_head(hidden).argmax(-1))  # the bias mattered
    torch.testing.assert_close(greedy.probs.sum(-1), torch.ones(2, drafter.config.block_size))
    hot = drafter.sample_block(hidden, ids[:, 10], lm_head, temperature=0.7, generator=torch.Generator().manual_seed(0))
    prev = torch.cat([ids[:, 10:11], hot.tokens[:, :-1]], dim=1)
    expected = torch.softmax((lm_head(hidden) + drafter.markov_bias(prev)) / 0.7, dim=-1)
    torch.testing.assert_close(hot.probs, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.softmax(hot.logits / 0.7, dim=-1), hot.probs, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        drafter.sample_block(hidden, ids[:, 10], lm_head, temperature=-1.0)


def test_confidence_logits_and_bad_inputs():
    drafter, embed, _ = build()
    features, ids, anchors, keep = batch(drafter.config)
    hidden = drafter(features, ids, anchors, keep, embed)
    logits = drafter.confidence_logits(hidden, ids[:, :1].expand(-1, anchors.shape[1])[..., None].expand(-1, -1, 4))
    assert logits.shape == hidden.shape[:3] and logits.dtype == torch.float32
    with pytest.raises(ValueError, match=r"context_features must be \[B, T, 384\]"):
        drafter(features[..., :-1], ids, anchors, keep, embed)
    with pytest.raises(ValueError, match=r"anchors must be positions in \[0, 24\)"):
        drafter(features, ids, anchors + 30, keep, embed)
    with pytest.raises(ValueError, match=r"kv_cache must be one of 'expanded', 'latent'"):
        DSparkDrafter(drafter.config, kv_cache="dense")
    with pytest.raises(ValueError, match="block_chunk must be a positive int or None"):
        DSparkDrafter(drafter.config, block_chunk=0)
    with pytest.raises(ValueError, match="no confidence head"):
        DSparkDrafter(drafter.config.replace(enable_confidence_head=False)).confidence_logits(hidden, ids[:, :1])
