"""Router and latent MoE (spec k3_target §2.5–2.6, §8.6)."""

import pytest
import torch

from lightning_eagle.k3 import config_from_name
from lightning_eagle.k3.moe import K3SparseMoE
from lightning_eagle.k3.router import K3Router


def _moe(preset="k3-tiny", seed=0, **overrides):
    torch.manual_seed(seed)
    moe = K3SparseMoE(config_from_name(preset, **overrides))
    for name, p in moe.named_parameters():
        torch.nn.init.normal_(p, std=0.3 if p.dim() == 3 else 0.1)
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(p, 0.5, 1.5)
    return moe


def test_router_is_fp32_even_under_autocast():
    router = _moe().gate
    x = torch.randn(16, 128)
    idx, w = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        idx_ac, w_ac = router(x)
    # exact: the router disables autocast, so both calls run the identical fp32 computation
    assert w.dtype == torch.float32 and torch.equal(idx, idx_ac) and torch.equal(w, w_ac)


def test_bias_selects_but_does_not_weight():
    router = _moe().gate
    x = torch.randn(32, 128)
    scores = torch.sigmoid(x @ router.weight.t())
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[5] = 10.0  # forces expert 5 into every top-k
    idx, w = router(x)
    assert (idx == 5).any(-1).all()
    expected = scores.gather(-1, idx)
    torch.testing.assert_close(w, expected / expected.sum(-1, keepdim=True))


def test_renormalise_and_scale():
    x = torch.randn(8, 128)
    plain = _moe(moe_renormalize=False).gate
    _, w_plain = plain(x)
    assert not torch.allclose(w_plain.sum(-1), torch.ones(8))
    _, w = _moe().gate(x)
    torch.testing.assert_close(w.sum(-1), torch.ones(8))
    _, w_scaled = _moe("k3-tiny-scaled").gate(x)
    torch.testing.assert_close(w_scaled, 2.5 * w)


def test_group_limited_routing_picks_from_the_best_group():
    router = _moe("k3-tiny-grouped").gate
    x = torch.randn(64, 128)
    idx, _ = router(x)
    groups = idx // 4
    assert (groups == groups[:, :1]).all()  # topk_group=1: both experts come from one group
    scores = torch.sigmoid(x @ router.weight.t()) + router.e_score_correction_bias
    group_score = scores.view(64, 2, 4).topk(2, -1).values.sum(-1)
    assert torch.equal(groups[:, 0], group_score.argmax(-1))


def test_grouped_experts_equal_per_expert_loop_and_latent_order():
    moe = _moe()
    x = torch.randn(40, 128)
    idx, w = moe.gate(x)
    z = moe.routed_expert_down_proj(x)
    za, zb = z.detach().clone().requires_grad_(), z.detach().clone().requires_grad_()
    fast, naive = moe.experts(za, idx, w.detach()), moe.experts.forward_naive(zb, idx, w.detach())
    torch.testing.assert_close(fast, naive, rtol=1e-6, atol=1e-6)
    grad_out = torch.randn_like(fast)
    (fast * grad_out).sum().backward()
    (naive * grad_out).sum().backward()
    torch.testing.assert_close(za.grad, zb.grad, rtol=1e-5, atol=1e-6)
    # norm after the weighted sum, up-projection after the norm, shared experts on the unprojected input
    r = moe.experts.forward_naive(z, idx, w)
    expected = moe.routed_expert_up_proj(moe.routed_expert_norm(r)) + moe.shared_experts(x)
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-6)
    assert moe.shared_experts.gate_proj.weight.shape == (64, 128)  # 2 shared experts × moe_intermediate 32


def test_expert_outputs_rounded_to_model_dtype_before_weighting():
    moe = _moe().to(torch.bfloat16)
    with torch.no_grad():
        moe.gate.weight.data = moe.gate.weight.float()  # the router weight is read in fp32 either way
    x = torch.randn(10, 128).bfloat16()
    idx, w = moe.gate(x)
    z = moe.routed_expert_down_proj(x)
    out = moe.experts(z, idx, w)
    assert out.dtype == torch.float32
    manual = torch.zeros(10, 96)
    # Each expert runs on the same rows (ascending tokens) as the grouped path: a bf16 GEMM over other row counts may
    # round differently on other CPUs, and a bf16-sized tolerance could no longer see the rounding order under test.
    for e in range(moe.experts.count):
        hit = idx == e
        rows = hit.any(-1)
        if rows.any():
            y = moe.experts.expert(e, z[rows])
            assert y.dtype == torch.bfloat16
            manual[rows] += (w * hit).sum(-1)[rows, None] * y.float()
    torch.testing.assert_close(out, manual, rtol=1e-6, atol=1e-6)


def test_partial_expert_slice_refuses_to_run_without_a_dispatcher():
    moe = K3SparseMoE(config_from_name("k3-tiny"), expert_range=(4, 4))
    assert moe.experts.gate_up_proj.shape[0] == 4
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    with pytest.raises(RuntimeError, match=r"holds experts \[4, 8\) of 8"):
        moe(torch.randn(3, 128))


def test_router_rejects_nothing_silently():
    with pytest.raises(ValueError, match="expert_range"):
        K3SparseMoE(config_from_name("k3-tiny"), expert_range=(6, 4))
    assert isinstance(_moe().gate, K3Router)
