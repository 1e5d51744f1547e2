"""Fused, chunked ``lm_head`` + soft cross-entropy of one TTT step (`eagle3_training.md` §5.2, §6.1): the
``loss_backend`` setting of :func:`~lightning_eagle.training.ttt_loss`.

``"plain"`` (the naive twin) computes ``z_k = draft.logits(h_k)`` ``[B,T,N_d]``, ``step_loss_fn(z_k, p, pos_k)``
against the teacher's ``[B,T,N_d]`` fp32 probabilities, and autograd keeps the logits and their fp32 log-softmax
for the backward, K times over. ``"chunked"`` computes the same

``L_k = Σ_t pos_k[t] · CE(p[t+k], log_softmax(lm_head(norm(h_t)))) / max(1, Σ pos_k)``

over the supervised slots only, ``loss_chunk`` rows at a time, inside one ``autograd.Function``
(:class:`FusedHeadSoftCE`): its forward keeps the step's hidden ``[B,T,H]`` (the next step keeps it anyway), the
``lm_head`` and final-norm weights and the slot index; its backward recomputes each chunk's normed rows, logits and
teacher probabilities (:meth:`~lightning_eagle.training.teacher.ChunkedTeacher.probs_at`) and writes the gradients of
``h``, ``lm_head.weight`` and the norm's parameters (accumulated in fp32 over chunks). No ``[*,N_d]`` tensor outlives
a chunk. The final norm runs inside the function so that its output ``[B,T,H]`` is not kept either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_eagle.draft.model import KimiK3Eagle3Draft
from lightning_eagle.settings import DEFAULT_LOSS_CHUNK
from lightning_eagle.training.teacher import ChunkedTeacher


@dataclass
class _Step:
    """What the function needs besides its tensor inputs (kept by reference, never copied)."""

    rows: torch.Tensor  # [R] long flat slot indices into B·T (supervised slots of step k)
    teacher: ChunkedTeacher
    k: int
    chunk: int
    norm: nn.Module | None  # the draft's final norm (None with norm_output: lm_head reads h directly)
    norm_names: tuple[str, ...]


def _normed(step: _Step, x: torch.Tensor, norm_params) -> torch.Tensor:
    if step.norm is None:
        return x
    return torch.func.functional_call(step.norm, dict(zip(step.norm_names, norm_params)), (x,))


class FusedHeadSoftCE(torch.autograd.Function):
    """``(hidden [B,T,H], lm_head.weight [N_d,H], step, *norm params) -> (L_k scalar fp32, draft argmax [R] long)``.

    Saved for the backward: ``hidden``, the weights (all already alive) and ``step.rows`` ``[R]``. Transient per
    chunk of ``C = step.chunk`` rows: ``[C,H]`` gathered / normed rows, ``[C,N_d]`` logits (model dtype) and about
    two ``[C,N_d]`` fp32 tensors (the log-softmax, reused in place for its product with the teacher or for the logit
    gradient; the teacher probabilities) plus an fp32 copy of the logits when they are not fp32, and for a
    hidden-source teacher its ``[C,H_t]`` rows and ``[C,N_d]`` fp32 logits (before their softmax).
    """

    @staticmethod
    def forward(ctx, hidden, weight, step: _Step, *norm_params):
        flat = hidden.reshape(-1, hidden.shape[-1])
        R = step.rows.numel()
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        preds = torch.empty(R, dtype=torch.long, device=hidden.device)
        for c0 in range(0, R, step.chunk):
            rows = step.rows[c0 : c0 + step.chunk]
            z = F.linear(_normed(step, flat.index_select(0, rows), norm_params), weight)
            log_probs = torch.log_softmax(z.float(), dim=-1)
            total -= log_probs.mul_(step.teacher.probs_at(rows + step.k)).sum()  # in place: one [C,N_d] fewer
            preds[c0 : c0 + step.chunk] = z.argmax(dim=-1)
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.step = step
        ctx.save_for_backward(hidden, weight, *norm_params)
        ctx.mark_non_differentiable(preds)
        return total / max(1, R), preds

    @staticmethod
    def backward(ctx, grad_loss, grad_preds):
        del grad_preds
        hidden, weight, *norm_params = ctx.saved_tensors
        step: _Step = ctx.step
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_norm = ctx.needs_input_grad[3:]
        H = hidden.shape[-1]
        flat = hidden.reshape(-1, H)
        R = step.rows.numel()
        scale = grad_loss.float() / max(1, R)
        grad_h = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # fp32 accumulators: a bf16 weight's gradient summed over many chunks in bf16 would lose bits per chunk
        grad_norm = [
            torch.zeros(p.shape, dtype=torch.float32, device=p.device) if n else None
            for p, n in zip(norm_params, need_norm)
        ]
        device_type, enabled, dtype = ctx.autocast
        for c0 in range(0, R, step.chunk):
            rows = step.rows[c0 : c0 + step.chunk]
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                x = flat.index_select(0, rows).detach().requires_grad_(need_h)
                leaves = [p.detach().requires_grad_(n) for p, n in zip(norm_params, need_norm)]
                normed = _normed(step, x, leaves)
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                n_rows = normed.detach()
                z = F.linear(n_rows, weight)
                probs = step.teacher.probs_at(rows + step.k)
                # d/dz of −Σ_v p·log_softmax(z) is softmax(z)·Σp − p (exp of the log-softmax, as autograd does)
                dz = torch.log_softmax(z.float(), dim=-1).exp_().mul_(probs.sum(-1, keepdim=True)).sub_(probs)
                dz = dz.mul_(scale).to(z.dtype)
                if need_w:
                    grad_w += (dz.t() @ n_rows).float()
                d_normed = dz @ weight if (need_h or any(need_norm)) else None
            if d_normed is None:
                continue
            wanted = [t for t, n in zip([x, *leaves], [need_h, *need_norm]) if n]
            if step.norm is None:
                grads = [d_normed] if need_h else []
            else:
                grads = list(torch.autograd.grad(normed, wanted, d_normed.to(normed.dtype)))
            if need_h:
                grad_h.view(-1, H).index_copy_(0, rows, grads.pop(0).to(hidden.dtype))
            for i, n in enumerate(need_norm):
                if n:
                    grad_norm[i] += grads.pop(0).float()
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            None,
            *[g.to(p.dtype) if g is not None else None for g, p in zip(grad_norm, norm_params)],
        )


def _check_draft(draft) -> None:
    if type(draft).logits is not KimiK3Eagle3Draft.logits:
        raise ValueError(
            f"loss_backend='chunked' fuses lm_head(norm(h)); {type(draft).__name__} overrides logits(), "
            "use loss_backend='plain'"
        )
    if draft.lm_head.bias is not None:
        raise ValueError("loss_backend='chunked' expects lm_head without bias; use loss_backend='plain'")
    tensors = [draft.lm_head.weight, *draft.norm.parameters()]
    if any(hasattr(t, "full_tensor") for t in tensors):
        # FSDP2 gathers a unit's weights only inside the module's own forward/backward, which the fused op bypasses
        raise ValueError(
            "loss_backend='chunked' does not support a sharded draft (draft_shard: true) yet: lm_head / norm are "
            "DTensors; use loss_backend='plain'"
        )


def chunked_step_loss(
    draft,
    hidden: torch.Tensor,
    teacher: ChunkedTeacher,
    k: int,
    *,
    chunk: int = DEFAULT_LOSS_CHUNK,
    all_argmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``k``'s loss ``L_k`` (differentiable, fp32 scalar) and the draft argmax ``[B,T]`` long.

    The argmax is computed where it is needed: on the supervised slots (the hit metrics), and everywhere with
    ``all_argmax`` (``return_argmax``); elsewhere it is −1, which never equals a teacher id.
    """
    _check_draft(draft)
    B, T, H = hidden.shape
    n = max(T - k, 0)
    pos_k = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
    pos_k[:, :n] = teacher.pos[:, k:]
    rows = pos_k.view(-1).nonzero().squeeze(1)
    norm = None if draft.config.norm_output else draft.norm
    names, params = zip(*norm.named_parameters()) if norm is not None else ((), ())
    step = _Step(rows=rows, teacher=teacher, k=k, chunk=chunk, norm=norm, norm_names=tuple(names))
    loss, preds = FusedHeadSoftCE.apply(hidden, draft.lm_head.weight, step, *params)
    argmax = torch.full((B * T,), -1, dtype=torch.long, device=hidden.device)
    argmax[rows] = preds
    if all_argmax:
        with torch.no_grad():
            rest = (~pos_k).view(-1).nonzero().squeeze(1)
            flat = hidden.detach().reshape(B * T, H)
            for c0 in range(0, rest.numel(), chunk):
                part = rest[c0 : c0 + chunk]
                argmax[part] = draft.logits(flat.index_select(0, part)).argmax(dim=-1)
    return loss, argmax.view(B, T)
