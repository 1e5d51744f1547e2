"""TTT attention at step k (`eagle3_training.md` §4.2, §8): queries of step k attend to the step-0 keys through the
causal ∧ key-not-pad block, plus one diagonal column per cached later step (slot t sees its own keys of steps 1..k).

Backends (a small registry; all take ``(q [B,n,T,d_qk], cache, scale)`` and return ``o [B,n,T,d_v]``):

* ``"eager"`` — the readable twin and the reference's exact formulation: materialises the ``[B,n,T,T+k]`` scores and
  fp32 probabilities. Default; used by the golden test.
* ``"flash_lse"`` — no ``[B,n,T,T+k]`` tensor: the causal block runs through an LSE-returning kernel
  (:mod:`lightning_eagle.draft.block_attention`), the k diagonal scores are ``[B,n,T,k]``, and the two are merged
  through the log-sum-exp inside a custom ``autograd.Function`` whose backward feeds the merged output and LSE to the
  block kernel's backward (the gradient trap of §8). Step 0 is the same function with no diagonal columns, i.e. plain
  causal attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_eagle.draft.block_attention import accumulate_dtype, default_kernel
from lightning_eagle.draft.cache import TTTCache

TTTAttention = Callable[[torch.Tensor, TTTCache, float], torch.Tensor]
_BACKENDS: dict[str, TTTAttention] = {}


def register_ttt_attention(name: str, fn: TTTAttention) -> None:
    _BACKENDS[name] = fn


def get_ttt_attention(name: str) -> TTTAttention:
    if name not in _BACKENDS:
        raise ValueError(f"unknown TTT attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def ttt_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


# ---- eager (the naive twin) ------------------------------------------------------------------------------------------
def eager_ttt_attention(q: torch.Tensor, cache: TTTCache, scale: float) -> torch.Tensor:
    """Scores ``[B,n,T,T+k]`` = (block over K_0 + mask) ‖ (one diagonal score per cached step 1..k); fp32 softmax."""
    T = q.shape[-2]
    k0, v0 = cache.keys[0], cache.values[0]
    scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
    scores = scores + cache.additive_mask(T, scores.dtype, scores.device)
    steps = len(cache) - 1
    if steps:
        later_k = torch.stack(cache.keys[1:], dim=0)  # [k,B,n,T,d_qk]
        diag = torch.einsum("bntc,sbntc->bnts", q, later_k) * scale  # Q_k[t]·K_i[t]
        scores = torch.cat([scores, diag], dim=-1)
    probs = torch.softmax(scores.to(accumulate_dtype(scores.dtype)), dim=-1).to(q.dtype)  # fp32 (fp64 stays fp64)
    out = torch.matmul(probs[..., :T], v0)
    if steps:
        later_v = torch.stack(cache.values[1:], dim=0)  # [k,B,n,T,d_v]
        out = out + torch.einsum("bnts,sbntd->bntd", probs[..., T:], later_v)
    return out


# ---- flash_lse (block kernel + diagonal columns merged through the LSE) ---------------------------------------------
class _LSEMergedTTTAttention(torch.autograd.Function):
    """``O = exp(lse_b − lse)·O_b + Σ_i exp(d_i − lse)·V_i[t]`` with ``lse = logaddexp(lse_b, logsumexp_i d_i)``.

    Forward/backward never hold more than ``[B,n,T,k]`` diagonal scores besides the kernel's own tiles. Later-step
    K/V are passed individually (not stacked) so that nothing O(k²) is saved across the unroll.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, mask, scale, kernel, num_diag, *later):
        later_k, later_v = later[:num_diag], later[num_diag:]
        acc = accumulate_dtype(q.dtype)
        out_b, lse_b = kernel.forward(q, k0, v0, mask, scale)
        if num_diag:
            diag = torch.einsum("bntc,sbntc->bnts", q.to(acc), torch.stack(later_k).to(acc)) * scale
            lse = torch.logaddexp(lse_b.to(acc), torch.logsumexp(diag, dim=-1))
            out = torch.exp(lse_b.to(acc) - lse)[..., None] * out_b.to(acc)
            out = out + torch.einsum("bnts,sbntd->bntd", torch.exp(diag - lse[..., None]), torch.stack(later_v).to(acc))
            out = out.to(q.dtype)
            lse = lse.to(lse_b.dtype)
        else:
            out, lse = out_b, lse_b
        ctx.save_for_backward(q, k0, v0, mask, out, lse, *later)
        ctx.scale, ctx.kernel, ctx.num_diag = scale, kernel, num_diag
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k0, v0, mask, out, lse, *later = ctx.saved_tensors
        scale, num_diag = ctx.scale, ctx.num_diag
        # Block columns: the kernel recomputes P = exp(S − lse) with the *merged* lse and uses D = rowsum(dO ⊙ O) with
        # the *merged* O, i.e. the block part of the full-row softmax gradient.
        dq, dk0, dv0 = ctx.kernel.backward(grad_out, q, k0, v0, mask, out, lse, scale)
        later_grads: list[torch.Tensor | None] = []
        if num_diag:
            acc = accumulate_dtype(q.dtype)
            later_k = torch.stack(later[:num_diag]).to(acc)
            later_v = torch.stack(later[num_diag:]).to(acc)
            q_acc, do = q.to(acc), grad_out.to(acc)
            diag = torch.einsum("bntc,sbntc->bnts", q_acc, later_k) * scale
            probs = torch.exp(diag - lse.to(acc)[..., None])  # [B,n,T,k]
            delta = (do * out.to(acc)).sum(-1, keepdim=True)
            ds = probs * (torch.einsum("bntd,sbntd->bnts", do, later_v) - delta)
            dq = (dq.to(acc) + torch.einsum("bnts,sbntc->bntc", ds, later_k) * scale).to(q.dtype)
            d_later_k = torch.einsum("bnts,bntc->sbntc", ds, q_acc) * scale
            d_later_v = torch.einsum("bnts,bntd->sbntd", probs, do)
            later_grads = [g.to(t.dtype) for g, t in zip(d_later_k.unbind(0), later[:num_diag])]
            later_grads += [g.to(t.dtype) for g, t in zip(d_later_v.unbind(0), later[num_diag:])]
        return (dq, dk0, dv0, None, None, None, None, *later_grads)


def flash_lse_ttt_attention(q: torch.Tensor, cache: TTTCache, scale: float, kernel=None) -> torch.Tensor:
    """The efficient TTT attention; ``kernel`` defaults to the fused CPU kernel on CPU, the chunked one elsewhere."""
    T = q.shape[-2]
    kernel = kernel or default_kernel(q)
    mask = cache.additive_mask(T, q.dtype, q.device)
    later = (*cache.keys[1:], *cache.values[1:])
    return _LSEMergedTTTAttention.apply(q, cache.keys[0], cache.values[0], mask, scale, kernel, len(cache) - 1, *later)


register_ttt_attention("eager", eager_ttt_attention)
register_ttt_attention("flash_lse", flash_lse_ttt_attention)
