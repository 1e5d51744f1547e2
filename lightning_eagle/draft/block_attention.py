"""Causal-block attention kernels that also return the row log-sum-exp, with a backward that takes the output and
LSE of the *whole* TTT row (`eagle3_training.md` §8, ``flash_lse``).

The TTT merge (:mod:`lightning_eagle.draft.ttt_attention`) runs the step-0 causal block through one of these kernels
and adds the diagonal columns itself. Its backward calls ``kernel.backward(dO, q, k, v, mask, O, lse)`` with the
*merged* output ``O`` and the *merged* ``lse``: the kernel then recomputes ``P = exp(S − lse)`` = the block columns of
the full-row softmax and ``D = rowsum(dO ⊙ O)`` = the full-row softmax-Jacobian term, which is exactly the block part
of the gradient of the merged attention. (Passing the block's own output/LSE instead would drop the gradient that
flows through the LSE — the bug SpecForge fixed in PRs #314/#536.)

Two kernels with the same contract:

* :class:`CpuFlashKernel` — torch's fused CPU flash-attention op (tiled; never materialises ``[B,n,T,T]``). It needs
  equal q/k and v head sizes, so the narrower side is zero-padded (zero columns change neither scores nor outputs).
* :class:`ChunkedKernel` — plain torch over query chunks (``[B,n,chunk,T]`` at a time); the device-agnostic fallback
  and the readable twin of the fused kernel.

``mask`` is the step-0 block's rule, in one of two forms (:data:`BlockRule`):

* a :class:`CausalBlock` — the long-context form, no ``[T,T]`` tensor: the batch is unpadded or right-padded, so a
  real query t sees exactly the keys 0..t (all real), and a padding query key 0 only. The fused CPU kernel runs with
  ``is_causal=True`` and patches the padding rows (``O(B·n·T·d)``); the chunked kernel builds each query chunk's
  ``[B|1,1,chunk,end]`` mask from the row lengths and skips the keys past the chunk (causal block skipping);
* the additive ``[B|1,1,T,T]`` causal ∧ key-not-pad mask in q's dtype (any other padding: left padding, holes).

Both forms are the same rule (:func:`lightning_eagle.ops.mla.causal_allowed_mask`), so every row — padding rows
included — equals the eager twin. Every row allows key 0, so no row is fully masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax/merge math runs in fp32 (fp64 stays fp64 so that float64 gradient checks are meaningful)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True, eq=False)
class CausalBlock:
    """The step-0 block of an unpadded or right-padded batch as a rule instead of a ``[T,T]`` tensor.

    ``lengths [B]`` (int64): row b's real slots are ``0..lengths[b]−1``; None = no padding (plain causal). A real query
    t sees keys ``0..t`` — all real, because padding only follows them — and a padding query sees key 0 only, which is
    :func:`~lightning_eagle.ops.mla.causal_allowed_mask` restricted to right padding."""

    lengths: torch.Tensor | None = None

    def real_queries(self, T: int, device: torch.device) -> torch.Tensor | None:
        """``[B,1,T,1]`` bool, True where the query slot is real; None without padding."""
        if self.lengths is None:
            return None
        slots = torch.arange(T, device=device)
        return (slots[None, :] < self.lengths.to(device)[:, None])[:, None, :, None]

    def allowed(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """``[B|1,1,end−start,end]`` bool: query rows ``start:end`` over keys ``0..end−1`` (no later key is allowed)."""
        rows = torch.arange(start, end, device=device)[:, None]
        keys = torch.arange(end, device=device)[None, :]
        causal = (keys <= rows)[None, None]
        if self.lengths is None:
            return causal
        real = rows[None, :, :] < self.lengths.to(device)[:, None, None]  # [B,chunk,1]
        return torch.where(real[:, None], causal, keys == 0)


BlockRule = torch.Tensor | CausalBlock


class ChunkedKernel:
    """Plain-torch causal block over query chunks: forward returns ``(o, lse)``; backward recomputes ``P`` per chunk."""

    name = "chunked"

    def __init__(self, chunk_size: int = 256) -> None:
        self.chunk_size = chunk_size

    @staticmethod
    def _keys(mask: BlockRule, T: int, end: int) -> int:
        """How many keys the query chunk ending at ``end`` can see: ``end`` under a causal rule, else all ``T``."""
        return end if isinstance(mask, CausalBlock) else T

    def _probs(self, q, k, mask, lse, start, end, scale):
        acc = accumulate_dtype(q.dtype)
        keys = self._keys(mask, q.shape[-2], end)
        scores = torch.matmul(q[..., start:end, :], k[..., :keys, :].transpose(-1, -2)).to(acc) * scale
        if isinstance(mask, CausalBlock):
            # Built per chunk from the rule: [B|1,1,chunk,end] at a time, never [T,T].
            scores = scores.masked_fill(~mask.allowed(start, end, q.device), torch.finfo(acc).min)
        else:
            scores = scores + mask[..., start:end, :].to(acc)
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
            return torch.exp(scores - lse[..., None]), lse
        return torch.exp(scores - lse[..., start:end, None]), None

    def forward(self, q, k, v, mask, scale):
        T = q.shape[-2]
        outs, lses = [], []
        for start in range(0, T, self.chunk_size):
            end = min(T, start + self.chunk_size)
            probs, lse = self._probs(q, k, mask, None, start, end, scale)
            outs.append(torch.matmul(probs.to(v.dtype), v[..., : probs.shape[-1], :]))
            lses.append(lse)
        return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)

    def backward(self, grad_out, q, k, v, mask, out, lse, scale):
        acc = accumulate_dtype(q.dtype)
        T = q.shape[-2]
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # D_t = dO_t · O_t (full-row softmax Jacobian term)
        k_acc, v_acc = k.to(acc), v.to(acc)
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for start in range(0, T, self.chunk_size):
            end = min(T, start + self.chunk_size)
            probs, _ = self._probs(q, k, mask, lse, start, end, scale)
            keys = probs.shape[-1]
            do = grad_out[..., start:end, :].to(acc)
            dp = torch.matmul(do, v_acc[..., :keys, :].transpose(-1, -2))
            ds = probs * (dp - delta[..., start:end, None])
            dq[..., start:end, :] = torch.matmul(ds, k_acc[..., :keys, :]) * scale
            dk[..., :keys, :] += torch.matmul(ds.transpose(-1, -2), q[..., start:end, :].to(acc)) * scale
            dv[..., :keys, :] += torch.matmul(probs.transpose(-1, -2), do)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class CpuFlashKernel:
    """torch's fused CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward).

    With a :class:`CausalBlock` it runs ``is_causal=True`` without any mask tensor; the padding query rows (which the
    causal kernel lets see keys 1..t) are then replaced by their key-0-only result, in the forward (output ``V[0]``,
    LSE the key-0 score) and in the backward (the kernel gets ``dO = 0`` and ``lse = +inf`` there, so those rows
    contribute nothing, and their key-0 gradient is added in ``O(B·n·T·d)``)."""

    name = "cpu_flash"
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

    @staticmethod
    def supports(q: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype in CpuFlashKernel.dtypes

    @staticmethod
    def _widths(q, v) -> tuple[int, int, int]:
        d_qk, d_v = q.shape[-1], v.shape[-1]
        return d_qk, d_v, max(d_qk, d_v)

    @staticmethod
    def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
        return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))

    @staticmethod
    def _split(mask: BlockRule) -> tuple[torch.Tensor | None, bool]:
        """The kernel's ``(attn_mask, is_causal)`` for this rule."""
        return (None, True) if isinstance(mask, CausalBlock) else (mask, False)

    @staticmethod
    def _key0_scores(q, k, scale) -> torch.Tensor:
        """``[B,n,T]`` score of every query against key 0 (the only key of a padding query), in the accumulate dtype."""
        acc = accumulate_dtype(q.dtype)
        return (q.to(acc) * k[..., :1, :].to(acc)).sum(-1) * scale

    def forward(self, q, k, v, mask, scale):
        d_qk, d_v, width = self._widths(q, v)
        attn_mask, is_causal = self._split(mask)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            self._pad(q, width),
            self._pad(k, width),
            self._pad(v, width),
            0.0,
            is_causal,
            attn_mask=attn_mask,
            scale=scale,
        )
        out = out[..., :d_v]
        real = mask.real_queries(q.shape[-2], q.device) if is_causal else None
        if real is not None:
            out = torch.where(real, out, v[..., :1, :])
            lse = torch.where(real[..., 0], lse, self._key0_scores(q, k, scale).to(lse.dtype))
        return out, lse

    def backward(self, grad_out, q, k, v, mask, out, lse, scale):
        d_qk, d_v, width = self._widths(q, v)
        attn_mask, is_causal = self._split(mask)
        real = mask.real_queries(q.shape[-2], q.device) if is_causal else None
        kernel_grad, kernel_lse = grad_out, lse
        if real is not None:
            # exp(S − inf) = 0 and dO = 0: the causal kernel's view of a padding row contributes exactly nothing.
            kernel_grad = grad_out.masked_fill(~real, 0)
            kernel_lse = lse.masked_fill(~real[..., 0], float("inf"))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            self._pad(kernel_grad.contiguous(), width),
            self._pad(q, width),
            self._pad(k, width),
            self._pad(v, width),
            self._pad(out.contiguous(), width),
            kernel_lse.contiguous(),
            0.0,
            is_causal,
            attn_mask=attn_mask,
            scale=scale,
        )
        dq, dk, dv = dq[..., :d_qk], dk[..., :d_qk], dv[..., :d_v]
        if real is not None:
            dq, dk, dv = self._padding_rows_backward(grad_out, q, k, v, out, lse, scale, ~real, dq, dk, dv)
        return dq, dk, dv

    def _padding_rows_backward(self, grad_out, q, k, v, out, lse, scale, pad, dq, dk, dv):
        """Add the block gradient of the padding query rows, whose block is key 0 alone (``P_0 = exp(s_0 − lse)``)."""
        acc = accumulate_dtype(q.dtype)
        do = grad_out.to(acc).masked_fill(~pad, 0)
        p0 = torch.exp(self._key0_scores(q, k, scale) - lse.to(acc)).masked_fill(~pad[..., 0], 0)  # [B,n,T]
        delta = (do * out.to(acc)).sum(-1)
        ds0 = p0 * ((do * v[..., :1, :].to(acc)).sum(-1) - delta)
        dq = (dq.to(acc) + ds0[..., None] * k[..., :1, :].to(acc) * scale).to(q.dtype)
        dk0 = (ds0[..., None] * q.to(acc)).sum(-2, keepdim=True) * scale
        dv0 = (p0[..., None] * do).sum(-2, keepdim=True)
        dk = torch.cat([(dk[..., :1, :].to(acc) + dk0).to(k.dtype), dk[..., 1:, :]], dim=-2)
        dv = torch.cat([(dv[..., :1, :].to(acc) + dv0).to(v.dtype), dv[..., 1:, :]], dim=-2)
        return dq, dk, dv


def default_kernel(q: torch.Tensor):
    """The fused CPU kernel where it applies, else the chunked torch kernel (e.g. CUDA; no fused LSE kernel with a
    key-padding mask and d_qk ≠ d_v has been verified there yet)."""
    return CpuFlashKernel() if CpuFlashKernel.supports(q) else ChunkedKernel()
