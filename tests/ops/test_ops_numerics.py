"""RMSNorm, SiTU and MLA numerics (spec k3_target §2.1–2.3, §8.2–8.4)."""

import torch

from lightning_eagle.k3 import config_from_name
from lightning_eagle.k3.layer import build_mla
from lightning_eagle.ops.mla import NoPEMLA, causal_additive_mask
from lightning_eagle.ops.norm import K3RMSNorm
from lightning_eagle.ops.situ import situ_and_mul


def test_rmsnorm_fp32_variance_and_cast_before_weight():
    torch.manual_seed(0)
    x = (torch.randn(4, 64) * 30).bfloat16()
    norm = K3RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    w = norm.weight.bfloat16()
    norm_bf16 = K3RMSNorm(64, eps=1e-5).bfloat16()
    with torch.no_grad():
        norm_bf16.weight.copy_(w)
    got = norm_bf16(x)
    x32 = x.float()
    ref = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    # exact: ref is the same op sequence on the same shapes; the contract is the bf16 rounding order itself
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    wrong_weight_in_fp32 = (w.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    var_bf16 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    wrong_bf16_variance = w * var_bf16
    assert not torch.equal(got, wrong_weight_in_fp32)
    assert not torch.equal(got, wrong_bf16_variance)
    # fp32 weight promotes; no (1 + w) offset: a zero weight gives zero
    assert K3RMSNorm(64)(x).dtype == torch.float32
    with torch.no_grad():
        norm.weight.zero_()
    assert norm(x.float()).abs().max() == 0


def test_norm_eps_choices():
    attn = build_mla(config_from_name("k3-tiny"))
    assert attn.q_a_layernorm.eps == 1e-6 and attn.kv_a_layernorm.eps == 1e-6
    from lightning_eagle.k3.layer import K3DecoderLayer

    layer = K3DecoderLayer(config_from_name("k3-tiny"), 3)
    assert layer.input_layernorm.eps == 1e-5 and layer.post_attention_layernorm.eps == 1e-5
    assert layer.block_sparse_moe.routed_expert_norm.eps == 1e-5


def test_situ_caps_and_swiglu_limit():
    g = torch.linspace(-20, 20, 401)
    u = torch.linspace(-100, 100, 401)
    a = situ_and_mul(g, torch.ones_like(g), 4.0, None)
    assert (a.abs() <= 4.0 * torch.sigmoid(g) + 1e-6).all()
    up = situ_and_mul(torch.full_like(u, 30.0), u, None, 25.0) / (30.0 * torch.sigmoid(torch.tensor(30.0)))
    assert up.abs().max() <= 25.0 + 1e-4 and up.abs().max() > 24.0
    big = situ_and_mul(g / 10, u / 10, 1e6, 1e6)
    swiglu = torch.nn.functional.silu(g / 10) * (u / 10)
    torch.testing.assert_close(big, swiglu, rtol=1e-5, atol=1e-5)
    assert situ_and_mul(g.bfloat16(), u.bfloat16(), 4.0, 25.0).dtype == torch.bfloat16


def _mla(seed=0):
    torch.manual_seed(seed)
    attn = build_mla(config_from_name("k3-tiny"))
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return attn


def test_mla_causal_and_scale():
    attn = _mla()
    assert attn.scale == (16 + 8) ** -0.5
    assert not any("rotary" in n for n, _ in attn.named_modules())
    x = torch.randn(2, 12, 128)
    y = attn(x)
    x2 = x.clone()
    x2[:, 7:] += torch.randn_like(x2[:, 7:])
    # exact: same shapes, and future keys enter slots < 7 only as exact zeros (masked softmax weights)
    torch.testing.assert_close(attn(x2)[:, :7], y[:, :7], rtol=0, atol=0)


def test_mla_rope_slice_shared_and_unnormalised():
    attn = _mla()
    x = torch.randn(1, 5, 128)
    q, k, v = attn.project(x)
    k_rot = k[..., 16:]
    assert torch.equal(k_rot, k_rot[:, :1].expand_as(k_rot))  # exact: one slice broadcast to every head
    raw_rot = attn.kv_a_proj_with_mqa(x)[..., 32:]
    torch.testing.assert_close(k_rot[:, 0], raw_rot)


def test_mla_gate_from_layer_input():
    attn = _mla()
    x = torch.randn(2, 6, 128)
    with torch.no_grad():
        attn.g_proj.weight.zero_()
    q, k, v = attn.project(x)
    probs = torch.softmax(q @ k.transpose(-1, -2) * attn.scale + causal_additive_mask(None, 6, x.dtype, "cpu"), -1)
    o = (probs @ v).transpose(1, 2).reshape(2, 6, -1)
    torch.testing.assert_close(attn(x), attn.o_proj(0.5 * o))


def test_mla_masked_padding_rows_stay_finite():
    attn = _mla()
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    add = causal_additive_mask(mask, 5, torch.float32, "cpu")
    assert torch.isfinite(attn(torch.randn(2, 5, 128), add)).all()
    # a padding query sees key 0 only
    assert (add[0, 0, 3] == 0).tolist() == [True, False, False, False, False]


def test_noPE_mla_constructor_variant_without_q_lora():
    attn = NoPEMLA(32, 32, 2, None, 8, 4, 2, 4)
    assert hasattr(attn, "q_proj") and not hasattr(attn, "q_a_proj")
    assert attn(torch.randn(1, 3, 32)).shape == (1, 3, 32)
