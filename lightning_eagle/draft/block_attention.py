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

``mask`` is the additive ``[B|1,1,T,T]`` causal ∧ key-not-pad mask in q's dtype; every row allows key 0, so no row is
fully masked and the first key tile always holds a real key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax/merge math runs in fp32 (fp64 stays fp64 so that float64 gradient checks are meaningful)."""
    return torch.promote_types(dtype, torch.float32)


class ChunkedKernel:
    """Plain-torch causal block over query chunks: forward returns ``(o, lse)``; backward recomputes ``P`` per chunk."""

    name = "chunked"

    def __init__(self, chunk_size: int = 256) -> None:
        self.chunk_size = chunk_size

    def _probs(self, q, k, mask, lse, start, end, scale):
        acc = accumulate_dtype(q.dtype)
        scores = torch.matmul(q[..., start:end, :], k.transpose(-1, -2)).to(acc) * scale
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
            outs.append(torch.matmul(probs.to(v.dtype), v))
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
            do = grad_out[..., start:end, :].to(acc)
            dp = torch.matmul(do, v_acc.transpose(-1, -2))
            ds = probs * (dp - delta[..., start:end, None])
            dq[..., start:end, :] = torch.matmul(ds, k_acc) * scale
            dk += torch.matmul(ds.transpose(-1, -2), q[..., start:end, :].to(acc)) * scale
            dv += torch.matmul(probs.transpose(-1, -2), do)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class CpuFlashKernel:
    """torch's fused CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward)."""

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

    def forward(self, q, k, v, mask, scale):
        d_qk, d_v, width = self._widths(q, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            self._pad(q, width), self._pad(k, width), self._pad(v, width), 0.0, False, attn_mask=mask, scale=scale
        )
        return out[..., :d_v], lse

    def backward(self, grad_out, q, k, v, mask, out, lse, scale):
        d_qk, d_v, width = self._widths(q, v)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            self._pad(grad_out.contiguous(), width),
            self._pad(q, width),
            self._pad(k, width),
            self._pad(v, width),
            self._pad(out.contiguous(), width),
            lse.contiguous(),
            0.0,
            False,
            attn_mask=mask,
            scale=scale,
        )
        return dq[..., :d_qk], dk[..., :d_qk], dv[..., :d_v]


def default_kernel(q: torch.Tensor):
    """The fused CPU kernel where it applies, else the chunked torch kernel (e.g. CUDA; no fused LSE kernel with a
    key-padding mask and d_qk ≠ d_v has been verified there yet)."""
    return CpuFlashKernel() if CpuFlashKernel.supports(q) else ChunkedKernel()
