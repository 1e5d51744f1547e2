"""The DSpark block objective over the supervised slots (DeepSpec's ``compute_dspark_loss``; issue 29, the shared
spec ``dspark.md``, "Training, as implemented").

Per supervised slot i (one row of :class:`DSparkRows`, slot index ``k_i``, weight ``w_i = exp(−k_i / decay)``):

* draft logits ``z_i = lm_head(h_i) + markov_w2(markov_w1[prev_i])`` (base logits plus the rank-r Markov bias);
* teacher ``p_t = softmax(lm_head_target(teacher_hidden_i))`` (the target's post-norm final hidden at the slot's
  position ``p + k``; no gradient);
* ``ce_i = −log softmax(z_i)[label_i]``, ``l1_i = ‖softmax(z_i) − p_t‖₁`` (twice the TV distance);
* confidence logit ``c_i = confidence([h_i ; markov_w1[prev_i]])`` against the stop-gradient target
  ``1 − ½ l1_i`` (clamped to [0, 1] against rounding): ``bce_i = BCE_with_logits(c_i, target_i)``;
* ``loss = world_size · Σ_i w_i (α_ce ce_i + α_l1 l1_i + α_conf bce_i) / normalizer``, all softmaxes in fp32.

Normalisation, as the reference does it: its three denominators are each the all-reduced ``Σ w·valid`` (the *weighted*
count of supervised slots, not the plain count) and it multiplies by the world size. ``normalizer`` is that global
``Σ w`` (:func:`global_slot_weight`; None = this rank's own, one process). Data-parallel training averages the ranks'
gradients (divides their sum by W), so the gradient applied is ``Σ_r ∇(Σ_{i∈r} w_i ℓ_i) / Σ_all w`` — the gradient of
one process holding every rank's rows — and the mean of the ranks' logged losses is that process's loss. The
reference adds 1e-6 to the denominator; ours is clamped at 1e-6 instead (the same for any non-empty batch, where
``Σ w ≥ exp(−(g−1)/decay)``; an empty batch is 0 either way).

Two twins with one signature: :func:`dspark_loss_plain` (full ``[N,V]`` softmaxes, autograd) and
:func:`dspark_loss_chunked` (:class:`FusedBlockLoss`: never more than ``chunk`` rows of ``[*,V]`` alive, forward
and backward — the backward recomputes each chunk's logits and teacher). The confidence head and the Markov
embedding ``markov_w1[prev]`` are ``[N, H+r]``-sized and stay in plain autograd in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_eagle.settings import DEFAULT_LOSS_CHUNK
from lightning_eagle.training.dspark_anchors import DSparkBlocks
from lightning_eagle.training.loss import block_slot_weights
from lightning_eagle.training.teacher import head_logits

_MIN_NORMALIZER = 1e-6


@dataclass(frozen=True)
class DSparkCoefficients:
    """The objective's term weights and slot decay (DeepSpec's ``ce/l1/confidence_head_alpha``, ``loss_decay_gamma``;
    the values of every public DSpark config)."""

    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    slot_decay: float = 4.0

    @classmethod
    def of(cls, objective) -> DSparkCoefficients:
        """The coefficients of a run's ``model.objective`` (:class:`~lightning_eagle.run_settings.
        DSparkObjectiveSettings`)."""
        return cls(objective.ce, objective.l1, objective.confidence, objective.slot_decay)

    def __post_init__(self) -> None:
        for name in ("ce", "l1", "confidence", "slot_decay"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (name == "slot_decay" and value == 0):
                wanted = "> 0" if name == "slot_decay" else ">= 0"
                raise ValueError(f"DSparkCoefficients.{name} must be a finite number {wanted}, got {value!r}")


@dataclass
class DSparkRows:
    """The supervised slots of a batch as flat rows (``DSparkBlocks.flat_rows`` order), N of them."""

    hidden: torch.Tensor  # [N,H] the drafter's final hidden after its final norm (what lm_head reads)
    prev_tokens: torch.Tensor  # [N] long, the Markov head's previous token
    labels: torch.Tensor  # [N] long, the hard next token
    slots: torch.Tensor  # [N] long, the slot index k in [0, g)
    teacher_hidden: torch.Tensor  # [N,H_t] the target's post-norm final hidden at position p + k
    block_size: int  # g (slots are in [0, g))


@dataclass
class DSparkHeads:
    """The weights the objective reads. ``lm_head_weight`` is shared with the target (frozen there);
    ``teacher_head_weight`` defaults to it (the drafter shares the target's head). The confidence head is vLLM's
    ``DSparkConfidenceHead``: a bias-optional ``Linear(H + r, 1)`` over ``[h ; markov_w1[prev]]`` in fp32, or over
    ``h`` alone with ``confidence_with_markov=False``; ``confidence_weight=None`` trains no confidence head (no BCE
    term, no confidence metrics)."""

    lm_head_weight: torch.Tensor  # [V,H]
    markov_w1: torch.Tensor  # [V,r] (an Embedding's weight)
    markov_w2: torch.Tensor  # [V,r] (a bias-free Linear(r, V)'s weight)
    confidence_weight: torch.Tensor | None  # [1, H+r] ([1, H] without the Markov input)
    confidence_bias: torch.Tensor | None = None  # [1]
    teacher_head_weight: torch.Tensor | None = None  # [V,H_t]
    confidence_with_markov: bool = True

    @property
    def teacher_head(self) -> torch.Tensor:
        head = self.lm_head_weight if self.teacher_head_weight is None else self.teacher_head_weight
        return head.detach()


@dataclass
class DSparkLoss:
    """The loss and what the metrics need. ``ce``/``l1``/``confidence`` are the terms' parts of ``loss`` (before
    their α, detached); ``tv`` and ``confidence_logit`` are per row, detached."""

    loss: torch.Tensor  # scalar fp32, differentiable
    ce: torch.Tensor
    l1: torch.Tensor
    confidence: torch.Tensor
    tv: torch.Tensor  # [N] fp32, ½‖p_d − p_t‖₁
    confidence_logit: torch.Tensor | None  # [N] fp32 (None without a confidence head)
    weights: torch.Tensor  # [N] fp32 slot weights w_i


def supervised_rows(blocks: DSparkBlocks, block_hidden: torch.Tensor, final_hidden: torch.Tensor) -> DSparkRows:
    """The :class:`DSparkRows` of ``blocks``' supervised slots: the drafter's normed final hidden of every slot
    ``block_hidden`` ``[B,A,g,H]`` (or ``[B,A·g,H]``) and the target's post-norm final hidden ``final_hidden``
    ``[B,T,H_t]`` (unshifted: the teacher of slot k is the target's prediction at position ``p + k``)."""
    B, A, g = blocks.valid.shape
    T = blocks.row_length
    if block_hidden.shape[:-1] not in ((B, A, g), (B, A * g)):
        raise ValueError(
            f"supervised_rows: block_hidden must be [B={B},A={A},g={g},H], got {tuple(block_hidden.shape)}"
        )
    if final_hidden.shape[:2] != (B, T):
        raise ValueError(f"supervised_rows: final_hidden must be [B={B},T={T},H_t], got {tuple(final_hidden.shape)}")
    flat, slots = blocks.flat_rows()
    index = blocks.valid.reshape(-1).nonzero().squeeze(1)
    return DSparkRows(
        hidden=block_hidden.reshape(B * A * g, -1).index_select(0, index),
        prev_tokens=blocks.prev_tokens.reshape(-1)[index],
        labels=blocks.labels.reshape(-1)[index],
        slots=slots,
        teacher_hidden=final_hidden.detach().reshape(B * T, -1).index_select(0, flat),
        block_size=g,
    )


def slot_weights(slots: torch.Tensor, block_size: int, decay: float) -> torch.Tensor:
    """``w_{k_i}`` ``[N]`` fp32 of the rows' slot indices ``slots`` ``[N]``; their sum is this rank's part of the
    normaliser (:func:`global_slot_weight`)."""
    return block_slot_weights(block_size, decay).to(slots.device)[slots]


def global_slot_weight(local: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``Σ w`` over the ranks of ``group`` (the data-parallel ranks whose gradients are averaged); ``local`` when no
    process group is initialised. Detached: the normaliser is a constant of the loss."""
    total = local.detach().float().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def _check(rows: DSparkRows, heads: DSparkHeads, world_size: int, chunk: int | None = None) -> None:
    N = rows.hidden.shape[0]
    V, H = heads.lm_head_weight.shape
    r = heads.markov_w1.shape[-1]
    shapes = {
        "hidden": (rows.hidden.shape, (N, H)),
        "prev_tokens": (rows.prev_tokens.shape, (N,)),
        "labels": (rows.labels.shape, (N,)),
        "slots": (rows.slots.shape, (N,)),
        "teacher_hidden": (rows.teacher_hidden.shape[:1], (N,)),
        "markov_w1": (heads.markov_w1.shape, (V, r)),
        "markov_w2": (heads.markov_w2.shape, (V, r)),
        "teacher_head_weight": (heads.teacher_head.shape, (V, rows.teacher_hidden.shape[-1])),
    }
    if heads.confidence_weight is not None:
        width = H + r if heads.confidence_with_markov else H
        shapes["confidence_weight"] = (heads.confidence_weight.shape, (1, width))
    if heads.confidence_bias is not None:
        shapes["confidence_bias"] = (heads.confidence_bias.shape, (1,))
    bad = [f"{name} {tuple(got)} (expected {want})" for name, (got, want) in shapes.items() if tuple(got) != want]
    if bad:
        raise ValueError("DSpark objective: wrong shapes: " + "; ".join(bad))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"DSpark objective: world_size must be an int >= 1, got {world_size!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"DSpark objective: chunk must be an int >= 1, got {chunk!r}")


def _finish(rows, heads, markov, main, tv, weights, coefficients, normalizer, world_size, parts) -> DSparkLoss:
    """The confidence term (plain autograd in both twins) and the normalisation."""
    logit, bce_sum = None, weights.new_zeros(())
    if heads.confidence_weight is not None:
        inputs = [rows.hidden, markov.to(rows.hidden.dtype)] if heads.confidence_with_markov else [rows.hidden]
        bias = None if heads.confidence_bias is None else heads.confidence_bias.float()
        logit = F.linear(torch.cat(inputs, dim=-1).float(), heads.confidence_weight.float(), bias).squeeze(-1)
        target = (1.0 - tv.detach()).clamp(0.0, 1.0)  # the stop-gradient target: its rounding clamped
        bce = F.binary_cross_entropy_with_logits(logit, target, reduction="none")
        bce_sum = (weights * bce).sum()
    if normalizer is None:
        normalizer = weights.sum()
    scale = world_size / torch.as_tensor(normalizer, dtype=torch.float32, device=weights.device).clamp_min(
        _MIN_NORMALIZER
    )
    loss = (main + coefficients.confidence * bce_sum) * scale
    ce_sum, l1_sum = parts
    return DSparkLoss(
        loss=loss,
        ce=(ce_sum * scale).detach(),
        l1=(l1_sum * scale).detach(),
        confidence=(bce_sum * scale).detach(),
        tv=tv.detach(),
        confidence_logit=None if logit is None else logit.detach(),
        weights=weights,
    )


def dspark_loss_plain(
    rows: DSparkRows,
    heads: DSparkHeads,
    *,
    coefficients: DSparkCoefficients = DSparkCoefficients(),
    normalizer: torch.Tensor | float | None = None,
    world_size: int = 1,
) -> DSparkLoss:
    """The readable twin: full ``[N,V]`` fp32 softmaxes of the draft and the teacher, autograd through all."""
    _check(rows, heads, world_size)
    weights = slot_weights(rows.slots, rows.block_size, coefficients.slot_decay)
    markov = F.embedding(rows.prev_tokens, heads.markov_w1)
    logits = (F.linear(rows.hidden, heads.lm_head_weight) + F.linear(markov, heads.markov_w2)).float()
    with torch.no_grad():
        teacher = torch.softmax(head_logits(rows.teacher_hidden.detach(), heads.teacher_head), dim=-1)
    ce = F.cross_entropy(logits, rows.labels, reduction="none")
    l1 = (torch.softmax(logits, dim=-1) - teacher).abs().sum(-1)
    ce_sum, l1_sum = (weights * ce).sum(), (weights * l1).sum()
    main = coefficients.ce * ce_sum + coefficients.l1 * l1_sum
    parts = (ce_sum.detach(), l1_sum.detach())
    return _finish(rows, heads, markov, main, 0.5 * l1, weights, coefficients, normalizer, world_size, parts)


@dataclass
class _Plan:
    """What :class:`FusedBlockLoss` needs besides its differentiable inputs (kept by reference, never copied)."""

    labels: torch.Tensor  # [N] long
    weights: torch.Tensor  # [N] fp32
    teacher_hidden: torch.Tensor  # [N,H_t], detached
    teacher_head: torch.Tensor  # [V,H_t], detached
    coefficients: DSparkCoefficients
    chunk: int


def _chunk_logits(hidden, markov, lm_head_weight, markov_w2, teacher_hidden, teacher_head):
    """``(draft logits [C,V] model dtype, teacher probabilities [C,V] fp32)`` of one chunk of rows."""
    logits = F.linear(hidden, lm_head_weight) + F.linear(markov, markov_w2)
    with torch.no_grad():
        teacher = torch.softmax(head_logits(teacher_hidden, teacher_head), dim=-1)
    return logits, teacher


class FusedBlockLoss(torch.autograd.Function):
    """``(hidden [N,H], markov [N,r], lm_head.weight [V,H], markov_w2 [V,r], plan) -> (Σ w (α_ce ce + α_l1 l1)
    fp32 scalar, tv [N] fp32, ce [N] fp32)``, ``chunk`` rows at a time (``tv`` and ``ce`` not differentiable).

    Saved: the four inputs (alive anyway) and the plan's ``[N]`` / ``[N,H_t]`` rows. Transient per chunk of C rows:
    the ``[C,V]`` logits (model dtype), about three ``[C,V]`` fp32 tensors (log-softmax / softmax, the teacher,
    their difference) and the teacher's ``[C,V]`` fp32 logits. The backward writes ``dz = w (α_ce (p − onehot) +
    α_l1 p ⊙ (s − ⟨s, p⟩))`` with ``s = sign(p − p_t)`` (the derivative of ``‖softmax(z) − p_t‖₁``; sign 0 at a tie,
    as autograd's ``abs``), then its products with the inputs, accumulating the weight gradients in fp32.
    """

    @staticmethod
    def forward(ctx, hidden, markov, lm_head_weight, markov_w2, plan: _Plan):
        N = hidden.shape[0]
        alpha_ce, alpha_l1 = plan.coefficients.ce, plan.coefficients.l1
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        tv = torch.empty(N, dtype=torch.float32, device=hidden.device)
        ce_rows = torch.empty(N, dtype=torch.float32, device=hidden.device)
        for c0 in range(0, N, plan.chunk):
            c1 = min(N, c0 + plan.chunk)
            logits, teacher = _chunk_logits(
                hidden[c0:c1], markov[c0:c1], lm_head_weight, markov_w2, plan.teacher_hidden[c0:c1], plan.teacher_head
            )
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            ce = -log_probs.gather(-1, plan.labels[c0:c1, None]).squeeze(-1)
            l1 = log_probs.exp_().sub_(teacher).abs_().sum(-1)  # in place: one [C,V] fewer
            total += (plan.weights[c0:c1] * (alpha_ce * ce + alpha_l1 * l1)).sum()
            tv[c0:c1], ce_rows[c0:c1] = 0.5 * l1, ce
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.plan = plan
        ctx.save_for_backward(hidden, markov, lm_head_weight, markov_w2)
        ctx.mark_non_differentiable(tv, ce_rows)
        return total, tv, ce_rows

    @staticmethod
    def backward(ctx, grad_total, grad_tv, grad_ce):
        del grad_tv, grad_ce
        hidden, markov, lm_head_weight, markov_w2 = ctx.saved_tensors
        plan: _Plan = ctx.plan
        need_h, need_m, need_w, need_w2 = ctx.needs_input_grad[:4]
        alpha_ce, alpha_l1 = plan.coefficients.ce, plan.coefficients.l1
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_m = torch.zeros_like(markov) if need_m else None
        # fp32 accumulators: a bf16 weight gradient summed over many chunks in bf16 would lose bits per chunk
        grad_w = torch.zeros(lm_head_weight.shape, dtype=torch.float32, device=hidden.device) if need_w else None
        grad_w2 = torch.zeros(markov_w2.shape, dtype=torch.float32, device=hidden.device) if need_w2 else None
        device_type, enabled, dtype = ctx.autocast
        N = hidden.shape[0]
        for c0 in range(0, N, plan.chunk):
            c1 = min(N, c0 + plan.chunk)
            h, m = hidden[c0:c1], markov[c0:c1]
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                logits, teacher = _chunk_logits(
                    h, m, lm_head_weight, markov_w2, plan.teacher_hidden[c0:c1], plan.teacher_head
                )
                probs = torch.softmax(logits.float(), dim=-1)
                sign = torch.sign(probs - teacher)
                del teacher
                # ∂l1/∂z = p ⊙ (s − ⟨s, p⟩); ∂ce/∂z = p − onehot(label)
                inner = (sign * probs).sum(-1, keepdim=True)
                dz = sign.sub_(inner).mul_(probs).mul_(alpha_l1).add_(probs, alpha=alpha_ce)
                del probs
                dz[torch.arange(c1 - c0, device=dz.device), plan.labels[c0:c1]] -= alpha_ce
                dz = dz.mul_((grad_total.float() * plan.weights[c0:c1])[:, None]).to(logits.dtype)
                if need_h:
                    grad_h[c0:c1] = (dz @ lm_head_weight).to(hidden.dtype)
                if need_m:
                    grad_m[c0:c1] = (dz @ markov_w2).to(markov.dtype)
                if need_w:
                    grad_w += (dz.t() @ h.to(dz.dtype)).float()
                if need_w2:
                    grad_w2 += (dz.t() @ m.to(dz.dtype)).float()
        return (
            grad_h,
            grad_m,
            grad_w.to(lm_head_weight.dtype) if need_w else None,
            grad_w2.to(markov_w2.dtype) if need_w2 else None,
            None,
        )


def dspark_loss_chunked(
    rows: DSparkRows,
    heads: DSparkHeads,
    *,
    coefficients: DSparkCoefficients = DSparkCoefficients(),
    normalizer: torch.Tensor | float | None = None,
    world_size: int = 1,
    chunk: int = DEFAULT_LOSS_CHUNK,
) -> DSparkLoss:
    """:func:`dspark_loss_plain`'s value and gradients with at most ``chunk`` rows of ``[*,V]`` alive at a time."""
    _check(rows, heads, world_size, chunk)
    weights = slot_weights(rows.slots, rows.block_size, coefficients.slot_decay)
    markov = F.embedding(rows.prev_tokens, heads.markov_w1)
    plan = _Plan(
        labels=rows.labels,
        weights=weights,
        teacher_hidden=rows.teacher_hidden.detach(),
        teacher_head=heads.teacher_head,
        coefficients=coefficients,
        chunk=chunk,
    )
    main, tv, ce = FusedBlockLoss.apply(rows.hidden, markov, heads.lm_head_weight, heads.markov_w2, plan)
    ce_sum, l1_sum = (weights * ce).sum(), (weights * 2 * tv).sum()
    return _finish(rows, heads, markov, main, tv, weights, coefficients, normalizer, world_size, (ce_sum, l1_sum))
