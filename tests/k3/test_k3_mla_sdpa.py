"""MLA attention twins: ``sdpa`` (fused kernels, the target's default) ↔ ``eager`` (readable), forward on every mask
kind, backward, bf16 accuracy, and the model-level switch."""

import pytest
import torch
from torch.profiler import profile

from lightning_eagle.inference.target_cache import MLALayerCache
from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name
from lightning_eagle.k3.layer import build_mla
from lightning_eagle.k3.model import attention_mask_for_mla, set_backends
from lightning_eagle.ops.mla import (
    MLA_BACKEND,
    NoPEMLA,
    causal_additive_mask,
    causal_allowed_mask,
    eager_attention,
    sdpa_attention,
)

T = 12


def _mla(seed=0, **widths) -> NoPEMLA:
    """k3-tiny's MLA (qk 24 > v 20), or the given widths; weights large enough for peaked attention."""
    torch.manual_seed(seed)
    if widths:
        attn = NoPEMLA(64, 64, 2, 16, 8, **widths)
    else:
        attn = build_mla(config_from_name("k3-tiny"))
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 0.1)
    return attn


def _masks():
    right = torch.tensor([[1] * T, [1] * 8 + [0] * 4])
    left = torch.tensor([[0] * 5 + [1] * 7, [1] * T])
    docs = torch.tensor([[1] * 4 + [2] * 5 + [3] * 3, [1] * 6 + [2] * 4 + [0] * 2])  # packed documents + padding
    return {
        "causal": None,
        "right padding": attention_mask_for_mla(right, T, "cpu"),
        "left padding": attention_mask_for_mla(left, T, "cpu"),
        "packed documents": attention_mask_for_mla(docs, T, "cpu"),
        "additive": causal_additive_mask(right, T, torch.float32, "cpu"),
    }


def _both(attn, x, mask=None, cache_factory=None):
    out = {}
    for name in ("eager", "sdpa"):
        attn.mla_backend = name
        out[name] = attn(x, mask) if cache_factory is None else cache_factory(attn)
    return out["eager"], out["sdpa"]


@pytest.mark.parametrize("kind", list(_masks()))
@pytest.mark.parametrize("widths", [{}, {"qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 8}])
def test_sdpa_equals_eager_fp32_on_every_mask(kind, widths):
    attn = _mla(**widths)
    x = torch.randn(2, T, 64 if widths else 128)
    eager, sdpa = _both(attn, x, _masks()[kind])
    assert torch.isfinite(sdpa).all()  # padding queries see key 0, never an empty row
    torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-5)


def test_masks_are_boolean_and_padding_rows_see_key0():
    mask = attention_mask_for_mla(torch.tensor([[1, 1, 2, 2, 0]]), 5, "cpu")
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 5, 5)
    assert mask[0, 0, 3].tolist() == [False, False, True, True, False]  # document 2 only, causal
    assert mask[0, 0, 4].tolist() == [True, False, False, False, False]  # padding query: key 0 only
    assert torch.equal(causal_additive_mask(None, 4, torch.float32, "cpu") == 0, causal_allowed_mask(None, 4, "cpu"))


def test_sdpa_cache_continuation_equals_full_eager():
    """Prefill 7 tokens, extend by 4 (several queries after a prefix), then by 1: the rows equal the full forward."""
    attn = _mla()
    x = torch.randn(2, T, 128)
    attn.mla_backend = "eager"
    full = attn(x)
    for name in ("sdpa", "eager"):
        attn.mla_backend = name
        cache = MLALayerCache()
        parts = [attn(x[:, :7], cache=cache), attn(x[:, 7:11], cache=cache), attn(x[:, 11:], cache=cache)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_sdpa_cache_with_left_padded_prefix_mask():
    """Batched decoding's form: an additive mask over cached + new keys (left padding in the prefix)."""
    attn = _mla()
    x = torch.randn(2, T, 128)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[0, :3] = False

    def run(a):
        cache = MLALayerCache()
        first = a(x[:, :9], causal_additive_mask(valid[:, :9], 9, torch.float32, "cpu"), cache=cache)
        rest = a(x[:, 9:], causal_additive_mask(valid, 3, torch.float32, "cpu", past_length=9), cache=cache)
        return torch.cat([first, rest], dim=1)

    eager, sdpa = _both(attn, x, cache_factory=run)
    assert torch.isfinite(sdpa).all()
    torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "packed documents"])
def test_sdpa_backward_equals_eager(kind):
    attn = _mla()
    x = torch.randn(2, T, 128)
    mask = _masks()[kind]
    grads = {}
    for name in ("eager", "sdpa"):
        attn.mla_backend = name
        attn.zero_grad()
        xi = x.clone().requires_grad_()
        (attn(xi, mask) * torch.linspace(-1, 1, 128)).sum().backward()
        grads[name] = [xi.grad] + [p.grad.clone() for p in attn.parameters()]
    for got, want in zip(grads["sdpa"], grads["eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_bf16_core_at_least_as_accurate_as_eager(padded):
    """bf16 q/k/v with peaked scores against an fp64 reference: the fused kernel's fp32 scores beat eager's bf16
    scores (fp32 softmax after bf16 rounding)."""
    torch.manual_seed(0)
    q, k = (2 * torch.randn(2, 4, 64, 192) for _ in range(2))
    v = torch.randn(2, 4, 64, 128)
    mask = causal_allowed_mask(torch.tensor([[1] * 50 + [0] * 14, [1] * 64]), 64, "cpu") if padded else None
    scale = 192**-0.5
    reference = eager_attention(q.double(), k.double(), v.double(), mask, scale)
    low = [t.bfloat16() for t in (q, k, v)]
    errors = {}
    for name, attend in (("eager", eager_attention), ("sdpa", sdpa_attention)):
        out = attend(*low, mask, scale)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        err = (out.double() - reference).abs()
        errors[name] = (err.max().item(), err.mean().item())
    assert errors["sdpa"][0] <= errors["eager"][0] and errors["sdpa"][1] <= errors["eager"][1], errors
    assert errors["sdpa"][0] < 0.05


def test_sdpa_bf16_module_within_tolerance():
    attn = _mla()
    x = torch.randn(2, T, 128)
    mask = _masks()["packed documents"]
    attn.mla_backend = "eager"
    reference = attn.double()(x.double(), mask).float()
    attn.bfloat16()
    eager, sdpa = (o.float() for o in _both(attn, x.bfloat16(), mask))
    tol = 2e-2 * reference.abs().max().item()
    torch.testing.assert_close(sdpa, reference, rtol=2e-2, atol=tol)
    torch.testing.assert_close(sdpa, eager, rtol=2e-2, atol=tol)


@pytest.mark.parametrize("kind", ["causal", "packed documents"])
def test_cpu_sdpa_runs_the_fused_kernel(kind):
    """Why v is padded to the qk width: with unequal widths torch falls back to the math kernel (full scores)."""
    attn = _mla()
    with profile() as prof:
        attn(torch.randn(2, T, 128), _masks()[kind])
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names


def test_model_switch_and_default():
    model = KimiK3ForCausalLM(config_from_name("k3-tiny")).init_weights(0).freeze()
    mlas = [m for m in model.modules() if isinstance(m, NoPEMLA)]
    assert mlas and all(m.mla_backend == "auto" for m in mlas)
    assert MLA_BACKEND.resolve("auto", torch.device("cpu")) == "sdpa"  # the default runs the fused kernels
    ids = torch.randint(0, 256, (2, T))
    docs = torch.tensor([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])
    default = model(ids, docs).logits
    assert set_backends(model, mla_backend="sdpa") is model
    assert torch.equal(model(ids, docs).logits, default)
    assert set_backends(model, mla_backend="eager") is model
    assert all(m.mla_backend == "eager" for m in mlas)
    valid = docs.bool()
    torch.testing.assert_close(default[valid], model(ids, docs).logits[valid], rtol=1e-4, atol=1e-4)
    built_eager = KimiK3ForCausalLM(config_from_name("k3-tiny"), mla_backend="eager")
    assert all(m.mla_backend == "eager" for m in built_eager.modules() if isinstance(m, NoPEMLA))
    with pytest.raises(ValueError, match="unknown MLA attention backend 'flash': mla_backend must be one of auto"):
        set_backends(model, mla_backend="flash")
    assert all(m.mla_backend == "eager" for m in mlas)  # a refused name changes nothing
    with pytest.raises(ValueError, match="mla_backend must be one of"):
        mlas[0].mla_backend = "flash"
