"""The draft unroll's backward, followed step by step from the last TTT step: gradient buffers, each stage's working
set, and the unroll's peak over forward and backward (:func:`unroll_peak`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_eagle.parallel.memory_plan.draft_forward import (
    DraftDims,
    cache_entry_bytes,
    loss_saved,
    norm_saved,
    step_kept,
    step_saved_parts,
)
from lightning_eagle.parallel.memory_plan.draft_shapes import DraftShapes
from lightning_eagle.parallel.memory_plan.inputs import FP32


def loss_backward_ws(d: DraftDims, k: int) -> int:
    """Soft-CE backward of step ``k``: the gradients w.r.t. the fp32 log-probs and the fp32 logits, ``[B,T−k,N_d]``
    each, are alive together."""
    return 2 * d.B * (d.T - k) * d.N_d * FP32


def mlp_backward_ws(d: DraftDims) -> int:
    """SiTU backward: the ``down_proj`` input gradient (draft dtype) and two fp32 ``[B,T,I]`` gradients at once."""
    return (d.s + 2 * FP32) * d.BT * d.I


def attention_backward_ws(d: DraftDims, k: int) -> int:
    """Backward of step ``k``'s TTT attention (``_LSEMergedTTTAttention.backward`` / eager autograd).

    ``flash_lse``: the block kernel's backward — on CUDA the chunked kernel holds fp32 ``k, v`` copies, fp32
    ``dq, dk, dv`` and six fp32 ``[B,n,256,T]`` score tiles; the fused CPU kernel pads grad/q/k/v/out to one width
    and returns padded grads — or the diagonal part after it: the stacked later-step K/V in fp32, their fp32
    gradients and the casts back (``k·[B,n,T,d_qk+d_v]·(4+4+s)``), fp32 ``q``/``dO``, and the kernel's returned
    grads. ``eager``: the gradients of the ``[B,n,T,T+k]`` probabilities (see below) and the stacked later-step K/V
    gradients."""
    BTn = d.BT * d.n
    if d.backend == "eager":
        # The two slices' zero-filled gradients and the block matmul's gradient (3 in the draft dtype), or later the
        # summed gradient with its fp32 copy and the fp32 softmax backward.
        probs = d.B * d.n * d.T * (d.T + k)
        return probs * max(3 * d.s, d.s + 2 * FP32) + k * BTn * (d.d_qk + d.d_v) * d.s
    if d.cpu:
        kernel = 6 * BTn * max(d.d_qk, d.d_v) * d.s
    else:
        # Per 256-query chunk: the previous chunk's probs/dP/dS are still referenced while the next chunk's scores,
        # scores − LSE and exp are formed: six fp32 [B,n,256,T] tiles (one chunk only: four).
        tiles = (6 if d.T > 256 else 4) * d.B * d.n * min(256, d.T) * d.T * FP32
        kernel = BTn * ((d.d_qk + d.d_v) * FP32 + (2 * d.d_qk + d.d_v) * FP32 + d.d_v * d.s) + tiles
    if k == 0:
        return kernel
    returned = BTn * (2 * d.d_qk + d.d_v) * d.s
    diagonal = k * BTn * (d.d_qk + d.d_v) * (2 * FP32 + d.s) + BTn * (d.d_qk + d.d_v) * FP32 + returned
    return max(kernel, diagonal)


def situ_forward_ws(d: DraftDims, saved: bool) -> int:
    """Transient of one SiTU forward beyond what it saves: the gate/up Linear outputs, their fp32 copies (not in
    fp32) and one temporary; without saving (a checkpointed step's first forward) all its fp32 intermediates."""
    copies = 0 if d.fp32 else 2 * FP32
    return (2 * d.s + copies + (1 if saved else 4) * FP32) * d.BT * d.I


@dataclass(frozen=True)
class UnrollPeak:
    kept_after_forward: int
    peak: int  # the unroll's own peak (gradient buffers included), on top of resident and inputs
    where: str
    stages: dict[str, int] = field(default_factory=dict)


def last_step_forward(d: DraftDims, checkpointing: bool, shared: int, kept: list[int]) -> int:
    """The forward's own peak: the last step's SiTU, before its final norm and loss exist (eager: the cache list,
    whose later entries the unroll drops on return, is still alive)."""
    peak = shared + sum(kept) - loss_saved(d, d.K - 1) - norm_saved(d, d.H) + situ_forward_ws(d, not checkpointing)
    if d.backend == "eager" and not checkpointing:
        peak += (d.K - 1) * cache_entry_bytes(d)
    return peak


def step_backward_stages(
    d: DraftDims, j: int, checkpointing: bool, shared: int, kept: list[int], shapes: DraftShapes
) -> dict[str, int]:
    """Live bytes at the worst point of each stage of back-propagating step ``j`` (loss → ``lm_head`` → MLP →
    attention output → attention core), with steps ``> j`` already freed.

    Gradient buffers: a parameter used by every step gets one, created while step K−1 is back-propagated (one
    weight at a time); each later step adds its new gradient out of place (new gradient + sum in flight). The
    gradients w.r.t. the cached K/V of steps ``≤ j`` wait in buffers until their step."""
    s, first = d.s, j == d.K - 1
    groups = {name: (numel * s, largest * s) for name, numel, largest in shapes.groups}

    def in_flight(group: str) -> int:
        return groups[group][1] * (1 if first else 2)

    def created(group: str) -> int:
        return groups[group][0] if first else 0

    parts = step_saved_parts(d, j)
    final_norm = norm_saved(d, d.H)
    buffers = 0 if first else shapes.unrolled * s + (j + 1) * d.BT * d.n * (d.d_qk + d.d_v) * s
    live = shared + sum(kept[: j + 1]) + buffers
    logits_grad = d.B * d.T * d.N_d * s
    stages = {"loss / lm_head": live + max(loss_backward_ws(d, j), logits_grad + in_flight("head"))}
    live += created("head") - loss_saved(d, j) - final_norm
    if checkpointing:  # the step's forward again, saving this time, with a second copy of its K/V
        live += sum(parts.values()) - parts["loss"] - final_norm + cache_entry_bytes(d)
        stages["recompute"] = live + situ_forward_ws(d, saved=True)
    stages["MLP"] = live + max(d.BT * d.I * s + in_flight("mlp"), mlp_backward_ws(d))
    live += created("mlp") - parts["SiTU MLP"] - norm_saved(d, d.H) - parts["attention output"]
    live += created("attention output")
    stages["attention"] = live + attention_backward_ws(d, j)
    return {f"{stage} backward of step {j}": value for stage, value in stages.items()}


def unroll_peak(d: DraftDims, checkpointing: bool, shared: int, shapes: DraftShapes) -> UnrollPeak:
    """The draft unroll's peak over its forward and a backward followed step by step (``j = K−1 … 0``; autograd
    back-propagates the last step first). The last candidate is ``fc``'s gradient, once per unroll, at the end."""
    kept = [step_kept(d, k, checkpointing) for k in range(d.K)]
    stages = {"last step forward": last_step_forward(d, checkpointing, shared, kept)}
    for j in reversed(range(d.K)):
        stages.update(step_backward_stages(d, j, checkpointing, shared, kept, shapes))
    stages["fc backward"] = shared + kept[0] + (shapes.unrolled + shapes.projection) * d.s
    where = max(stages, key=stages.__getitem__)
    return UnrollPeak(kept_after_forward=shared + sum(kept), peak=stages[where], where=where, stages=stages)
