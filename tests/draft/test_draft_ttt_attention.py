"""TTT attention backends (§4.2, §8): eager == a naive per-slot loop; flash_lse == eager in forward *and* backward
(q, every cached K/V), with both block kernels and d_qk ≷ d_v; flash_lse keeps no [B,n,T,T+k] tensor for backward.
The concatenated-key backends (sdpa_mask, flex_attention) and ``auto`` are in ``test_draft_ttt_fused_attention.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_eagle.draft import TTTCache
from lightning_eagle.draft.block_attention import ChunkedKernel, CpuFlashKernel
from lightning_eagle.draft.ttt_attention import (
    eager_ttt_attention,
    flash_lse_ttt_attention,
    get_ttt_attention,
    ttt_attention_backends,
)

B, N, T = 2, 3, 7


def padding_mask():
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0  # row 1: two padding slots (their queries see key 0 only)
    return mask


def make_inputs(steps, d_qk=24, d_v=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, T, d_qk, generator=g, dtype=dtype).requires_grad_()
    keys = [torch.randn(B, N, T, d_qk, generator=g, dtype=dtype).requires_grad_() for _ in range(steps + 1)]
    values = [torch.randn(B, N, T, d_v, generator=g, dtype=dtype).requires_grad_() for _ in range(steps + 1)]
    weight = torch.randn(B, N, T, d_v, generator=g, dtype=dtype)
    return q, keys, values, weight


def run(fn, q, keys, values, weight, mask, scale=0.3):
    """Output and gradients of ``Σ weight · attention(q, cache)`` w.r.t. q and every cached K/V."""
    cache = TTTCache()
    cache.bind_mask(mask)
    for k, v in zip(keys, values):
        cache.append(k, v)
    out = fn(q, cache, scale)
    grads = torch.autograd.grad((out * weight).sum(), [q, *keys, *values])
    return out.detach(), grads


def naive_ttt_attention(q, cache, scale):
    """Per (row, slot): softmax over [allowed step-0 keys ‖ this slot's keys of steps 1..k] — the spec's definition."""
    mask = cache.attention_mask.bool()
    rows = []
    for b in range(q.shape[0]):
        slots = []
        for t in range(q.shape[2]):
            allowed = [j for j in range(t + 1) if mask[b, j]] if mask[b, t] else [0]
            keys = torch.cat([cache.keys[0][b][:, allowed]] + [k[b][:, t : t + 1] for k in cache.keys[1:]], dim=1)
            values = torch.cat([cache.values[0][b][:, allowed]] + [v[b][:, t : t + 1] for v in cache.values[1:]], 1)
            probs = torch.softmax(torch.einsum("nd,nld->nl", q[b, :, t], keys) * scale, dim=-1)
            slots.append(torch.einsum("nl,nld->nd", probs, values))
        rows.append(torch.stack(slots, dim=1))
    return torch.stack(rows)


def assert_same(a, b, atol):
    out_a, grads_a = a
    out_b, grads_b = b
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=atol)
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        torch.testing.assert_close(ga, gb, rtol=0, atol=atol, msg=lambda m, i=i: f"gradient {i}: {m}")


def test_registry():
    assert ttt_attention_backends() == ["auto", "eager", "flash_lse", "flex_attention", "sdpa_mask"]
    with pytest.raises(ValueError, match="unknown TTT attention backend 'flex'"):
        get_ttt_attention("flex")


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_eager_matches_naive_loop(steps):
    inputs = make_inputs(steps)
    assert_same(
        run(eager_ttt_attention, *inputs, padding_mask()), run(naive_ttt_attention, *inputs, padding_mask()), 1e-12
    )


@pytest.mark.parametrize("kernel", [CpuFlashKernel(), ChunkedKernel(chunk_size=3)], ids=["cpu_flash", "chunked"])
@pytest.mark.parametrize("dims", [(24, 16), (16, 24), (20, 20)], ids=["dqk>dv", "dqk<dv", "equal"])
@pytest.mark.parametrize("steps", [0, 1, 2, 6])
def test_flash_lse_matches_eager_forward_and_backward(kernel, dims, steps):
    inputs = make_inputs(steps, *dims)

    def flash(q, cache, scale):
        return flash_lse_ttt_attention(q, cache, scale, kernel=kernel)

    assert_same(run(flash, *inputs, padding_mask()), run(eager_ttt_attention, *inputs, padding_mask()), 1e-12)


def test_flash_lse_fp32_and_no_padding():
    inputs = make_inputs(3, dtype=torch.float32)
    assert_same(run(flash_lse_ttt_attention, *inputs, None), run(eager_ttt_attention, *inputs, None), 2e-6)


def test_a_merge_without_the_lse_gradient_is_caught():
    """The §8 trap: merging with a block LSE that carries no gradient gives wrong q/K_0 gradients; the comparison used
    above must see that (so it can fail)."""

    def detached_lse_merge(q, cache, scale):
        kernel, T = ChunkedKernel(), q.shape[-2]
        mask = cache.additive_mask(T, q.dtype, q.device)
        scores = torch.matmul(q, cache.keys[0].transpose(-1, -2)) * scale + mask
        out_b = torch.matmul(torch.softmax(scores, -1), cache.values[0])
        _, lse_b = kernel.forward(q.detach(), cache.keys[0].detach(), cache.values[0], mask, scale)
        diag = torch.einsum("bntc,sbntc->bnts", q, torch.stack(cache.keys[1:])) * scale
        lse = torch.logaddexp(lse_b, torch.logsumexp(diag, -1))
        out = torch.exp(lse_b - lse)[..., None] * out_b
        return out + torch.einsum("bnts,sbntd->bntd", torch.exp(diag - lse[..., None]), torch.stack(cache.values[1:]))

    inputs = make_inputs(2)
    wrong, right = run(detached_lse_merge, *inputs, padding_mask()), run(eager_ttt_attention, *inputs, padding_mask())
    torch.testing.assert_close(wrong[0], right[0], rtol=0, atol=1e-12)  # forward agrees …
    assert (wrong[1][0] - right[1][0]).abs().max() > 1e-3  # … the q gradient does not


def saved_shapes(fn, steps, T_=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, T_, 24, generator=g, requires_grad=True)
    cache = TTTCache()
    cache.bind_mask(torch.ones(1, T_, dtype=torch.long))
    for _ in range(steps + 1):
        cache.append(torch.randn(1, 2, T_, 24, requires_grad=True), torch.randn(1, 2, T_, 16, requires_grad=True))
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, cache, 0.2).sum().backward()
    return shapes


def test_flash_lse_saves_no_score_tensor():
    T_ = 64
    eager = saved_shapes(eager_ttt_attention, 3, T_)
    flash = saved_shapes(flash_lse_ttt_attention, 3, T_)
    big = [s for s in eager if len(s) == 4 and s[-2] == T_ and s[-1] >= T_]
    assert big, "the eager twin should keep [B,n,T,T+k] scores (otherwise this check proves nothing)"
    # Only the additive [B,1,T,T] mask (shared, constant for the whole unroll) may be T×T; nothing with n heads.
    assert not [s for s in flash if len(s) == 4 and s[-2] == T_ and s[-1] >= T_ and s[1] != 1]


def test_flash_lse_bf16_backward_is_close_to_eager():
    """bf16 inputs: the fused kernel keeps an fp32 LSE; gradients stay within bf16 rounding of the eager twin's."""
    q, keys, values, weight = make_inputs(3, dtype=torch.float32, seed=4)
    as_bf16 = [t.detach().bfloat16().requires_grad_() for t in (q, *keys, *values)]
    q16, keys16, values16 = as_bf16[0], as_bf16[1:5], as_bf16[5:]
    flash = run(flash_lse_ttt_attention, q16, keys16, values16, weight.bfloat16(), padding_mask())
    eager = run(eager_ttt_attention, q16, keys16, values16, weight.bfloat16(), padding_mask())
    exact = run(eager_ttt_attention, q, keys, values, weight, padding_mask())
    for got, ref, true in zip((flash[0], *flash[1]), (eager[0], *eager[1]), (exact[0], *exact[1])):
        assert got.dtype == torch.bfloat16
        # flash_lse is no further from the fp32 result than the bf16 eager twin is (up to a small slack)
        err_flash = (got.float() - true).abs().max()
        err_eager = (ref.float() - true).abs().max()
        assert err_flash <= 1.5 * err_eager + 1e-3, (err_flash, err_eager)
