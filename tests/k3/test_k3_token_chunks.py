"""Token-chunked target forward (``token_chunk``) == the unchunked forward, its twin (``k3/token_chunks.py``).

fp32 tiny targets, right-padded batches. The chunked form regroups the KDA chunks and MLA products, so results agree
to fp32 rounding — the size of the existing KDA ``naive`` ↔ ``chunk`` gap on these models (≈ 2e-5 on a final hidden
of magnitude ≈ 4), hence ``atol=rtol=1e-4``; a lost KDA state, conv tail or MLA prefix shifts outputs by O(1).
Padding positions agree too (no assertion is restricted to real positions).
"""

from __future__ import annotations

import pytest
import torch
from k3_helpers import tiny_model

from lightning_eagle.k3 import token_chunks
from lightning_eagle.k3.model import KimiK3ForCausalLM, set_backends, set_token_chunk
from lightning_eagle.k3.moe import local_dispatch

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, preset: str) -> KimiK3ForCausalLM:
    if preset not in models:
        models[preset] = tiny_model(preset, kda_backend="chunk")
    return models[preset]


def _batch(T: int = 23, B: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    if B > 1:
        mask[1, T - 7 :] = 0  # right padding
    return ids, mask


def _capture(model, ids, mask, token_chunk, aux_stream):
    L = model.config.num_hidden_layers
    set_token_chunk(model, token_chunk)
    try:
        with torch.no_grad():
            return model.capture(ids, mask, [0, L // 2, L - 1], aux_stream, return_logits=True, return_prenorm=True)
    finally:
        set_token_chunk(model, None)


PRESETS = ["k3-tiny", "k3-tiny-no-attnres", "k3-tiny-partial-block", "k3-tiny-trailing-mla"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("token_chunk", [1, 5, 8])
def test_chunked_capture_equals_unchunked(models, preset, token_chunk):
    model = _model(models, preset)
    ids, mask = _batch()  # T = 23: no chunk size here divides it
    for stream in ("prefix", "mixed"):
        want = _capture(model, ids, mask, None, stream)
        got = _capture(model, ids, mask, token_chunk, stream)
        for name in ("aux_hidden_states", "final_hidden", "logits", "final_prenorm"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, **TOL, msg=f"{preset} C={token_chunk} {stream} {name}")


@pytest.mark.parametrize("mla_backend", ["sdpa", "eager"])
def test_unpadded_batch_and_chunk_longer_than_the_sequence(mla_backend):
    """No mask: the SDPA segments after the first run causal bottom-right without a mask tensor."""
    model = set_backends(tiny_model("k3-tiny", kda_backend="chunk"), mla_backend=mla_backend)
    ids, _ = _batch(T=19, B=1)
    want = model(ids).logits
    for token_chunk in (1, 4, 19, 64):
        set_token_chunk(model, token_chunk)
        with torch.no_grad():
            got = model(ids).logits
        set_token_chunk(model, None)
        torch.testing.assert_close(got, want, **TOL, msg=f"C={token_chunk}")


def test_eager_mla_and_naive_kda_backends_chunked(models):
    model = tiny_model("k3-tiny", kda_backend="naive")
    model.model.layers[4].self_attn.mla_backend = "eager"
    ids, mask = _batch(T=13)
    want = _capture(model, ids, mask, None, "prefix")
    got = _capture(model, ids, mask, 3, "prefix")
    torch.testing.assert_close(got.final_hidden, want.final_hidden, **TOL)
    torch.testing.assert_close(got.aux_hidden_states, want.aux_hidden_states, **TOL)


def test_layer_major_segments_and_segment_sized_masks(models, monkeypatch):
    """Each layer runs once per forward (one FSDP2 gather, one aux hook), in order; each MoE runs once per segment;
    MLA masks are ``[C, T_so_far]`` and the ``[B,1,T,T]`` mask is never built."""
    model = _model(models, "k3-tiny")
    ids, mask = _batch(T=23)
    calls, masks = [], []
    handles = [layer.register_forward_pre_hook(lambda m, a: calls.append(m.layer_idx)) for layer in model.model.layers]
    moe_calls = {i: 0 for i, layer in enumerate(model.model.layers) if hasattr(layer, "block_sparse_moe")}
    for i in moe_calls:
        moe = model.model.layers[i].block_sparse_moe
        handles.append(moe.register_forward_pre_hook(lambda m, a, i=i: moe_calls.__setitem__(i, moe_calls[i] + 1)))
    real_mask = token_chunks.causal_allowed_mask
    monkeypatch.setattr(token_chunks, "causal_allowed_mask", lambda *a, **k: _record(masks, real_mask(*a, **k)))

    def refuse(*_a, **_k):
        raise AssertionError("the full [B,1,T,T] mask was built")

    monkeypatch.setattr("lightning_eagle.k3.model.attention_mask_for_mla", refuse)
    try:
        set_token_chunk(model, 5)
        with torch.no_grad():
            model(ids, mask)
    finally:
        set_token_chunk(model, None)
        for h in handles:
            h.remove()
    assert calls == list(range(model.config.num_hidden_layers))
    assert set(moe_calls.values()) == {5}  # ceil(23 / 5)
    mla_layers = sum(1 for layer in model.model.layers if not layer.is_kda)
    assert len(masks) == 5 * mla_layers
    assert {tuple(s) for s in masks[:5]} == {(2, 1, 5, 5), (2, 1, 5, 10), (2, 1, 5, 15), (2, 1, 5, 20), (2, 1, 3, 23)}


def _record(masks, mask):
    masks.append(mask.shape)
    return mask


class _PaddedLocalDispatch:
    """The single-process dispatch, but agreeing on two segments more than this process needs (as an EP rank with
    fewer tokens than another would); counts the MoE calls on empty inputs."""

    def __init__(self) -> None:
        self.empty_calls = 0

    def __call__(self, experts, z, topk_idx, topk_weight):
        self.empty_calls += z.shape[0] == 0
        return local_dispatch(experts, z, topk_idx, topk_weight)

    def max_over_group(self, value: int, device) -> int:
        return value + 2


def test_empty_segments_run_the_moe_on_zero_tokens():
    model = tiny_model("k3-tiny", kda_backend="chunk")
    ids, mask = _batch(T=11)
    want = _capture(model, ids, mask, None, "mixed")
    dispatch = _PaddedLocalDispatch()
    moes = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    for moe in moes:
        moe.dispatch = dispatch
    got = _capture(model, ids, mask, 4, "mixed")
    assert dispatch.empty_calls == 2 * len(moes)
    torch.testing.assert_close(got.final_hidden, want.final_hidden, **TOL)
    torch.testing.assert_close(got.aux_hidden_states, want.aux_hidden_states, **TOL)


def test_token_segments_bounds():
    assert token_chunks.TokenSegments(7, 3, 4).bounds == [(0, 3), (3, 6), (6, 7), (7, 7)]
    with pytest.raises(ValueError, match="cannot cover"):
        token_chunks.TokenSegments(7, 3, 2)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "8"])
def test_bad_token_chunk_is_refused_naming_the_setting(models, bad):
    model = _model(models, "k3-tiny")
    with pytest.raises(ValueError, match="token_chunk must be a positive int"):
        set_token_chunk(model, bad)
    with pytest.raises(ValueError, match="token_chunk must be a positive int"):
        model.model.token_chunk = bad
    assert model.model.token_chunk is None


def test_constructor_setting_and_packed_masks_refused():
    model = KimiK3ForCausalLM(tiny_model().config, token_chunk=4).init_weights(0).freeze()
    assert model.model.token_chunk == 4
    ids, _ = _batch(T=9, B=1)
    packed = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0, 0]])
    with pytest.raises(ValueError, match="token_chunk=4 needs a binary attention_mask"), torch.no_grad():
        model(ids, packed)


def test_grad_mode_is_refused_for_trainable_weights_and_harmless_for_frozen_ones(models):
    model = _model(models, "k3-tiny")
    ids, _ = _batch(T=9, B=1)
    set_token_chunk(model, 4)
    try:
        out = model(ids).logits  # grad mode on, weights frozen: runs without a graph
        assert not out.requires_grad
        model.model.norm.weight.requires_grad_(True)
        with pytest.raises(RuntimeError, match="token_chunk=4 runs the frozen target without autograd"):
            model(ids)
    finally:
        model.model.norm.weight.requires_grad_(False)
        set_token_chunk(model, None)


def test_mxfp4_experts_decode_once_per_layer_not_per_segment(monkeypatch):
    from lightning_eagle.k3 import experts as experts_module
    from lightning_eagle.k3.mxfp4 import encode_mxfp4

    model = KimiK3ForCausalLM(tiny_model().config, kda_backend="chunk", expert_storage="mxfp4").init_weights(0)
    gen = torch.Generator().manual_seed(0)
    moes = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    with torch.no_grad():
        for ex in (moe.experts for moe in moes):
            for stem in ("gate_up", "down"):
                packed = getattr(ex, f"{stem}_packed")
                for e in range(ex.count):
                    rows, cols = packed.shape[1], 2 * packed.shape[2]
                    p, s = encode_mxfp4(0.3 * torch.randn(rows, cols, generator=gen))
                    packed[e], getattr(ex, f"{stem}_scale")[e] = p, s
    model.freeze()
    decodes = []
    real = experts_module.decode_mxfp4
    monkeypatch.setattr(experts_module, "decode_mxfp4", lambda *a, **k: decodes.append(1) or real(*a, **k))
    ids, mask = _batch(T=13)
    want = _capture(model, ids, mask, None, "prefix")
    assert len(decodes) == 2 * len(moes)  # gate_up and down of each MoE layer
    got = _capture(model, ids, mask, 4, "prefix")  # 4 segments per layer
    assert len(decodes) == 4 * len(moes)
    assert all(moe.experts._decoded is None for moe in moes)  # released after each layer
    torch.testing.assert_close(got.final_hidden, want.final_hidden, **TOL)
    torch.testing.assert_close(got.aux_hidden_states, want.aux_hidden_states, **TOL)
