"""The EAGLE-3 draft unroll's backward, followed step by step from the last TTT step: gradient buffers, each stage's
working set, and the unroll's peak over forward and backward (:func:`unroll_peak`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_eagle.draft import ttt_attention
from lightning_eagle.planning.draft_shapes import DraftShapes
from lightning_eagle.planning.eagle3_unroll_forward import (
    DraftDims,
    cache_entry_bytes,
    cache_entry_kept,
    eager_mask_bytes,
    final_norm_saved,
    loss_saved,
    norm_saved,
    step_kept,
    step_saved_parts,
)
from lightning_eagle.planning.terms import FP32


def loss_backward_ws(d: DraftDims, k: int) -> int:
    """Soft-CE backward of step ``k`` (``plain``): the gradients w.r.t. the fp32 log-probs and the fp32 logits,
    ``[B,T−k,N_d]`` each, are alive together."""
    return 2 * d.supervised(k) * d.N_d * FP32


def chunked_chunk_ws(d: DraftDims, k: int, backward: bool) -> int:
    """One chunk of ``FusedHeadSoftCE`` (``training/chunked_loss.py``) over ``C`` rows, at its worst point.

    Forward: the gathered rows ``[C,H]``, their norm (fp32 copy, normed, output), the logits ``[C,N_d]`` beside their
    fp32 log-softmax and the teacher's fp32 logits and probabilities (``ChunkedTeacher.probs_at``: the gathered
    ``[C,H_t]`` target rows, their ``[C,N_d]`` logits, in fp32, then their softmax).
    Backward: the same rows and norm (with autograd's saved tensors), the logits, the teacher probabilities and the
    logit gradient (fp32, then in the draft dtype) — with several chunks, the previous chunk's logits,
    probabilities and logit gradient are still referenced while the next chunk's are formed — or ``lm_head``'s
    chunk gradient ``dzᵀ·normed`` ``[N_d,H]`` and its fp32 copy (added to the fp32 accumulator)."""
    C, s = d.chunk_rows(k), d.s
    copy32 = 0 if d.fp32 else FP32  # x.float() of an fp32 tensor is the tensor itself
    rows = C * d.H * (3 * s + copy32) + C * d.H_t * d.s_t
    teacher = 2 * FP32  # fp32 teacher logits (or the fp32 Linear output itself) and their softmax
    if not backward:
        return rows + C * d.N_d * (s + FP32 + max(teacher, copy32))
    multi = d.supervised(k) > C  # the previous chunk's probabilities and logit gradient are still referenced
    coefficient = max(
        s + teacher + ((FP32 + s) if multi else 0),  # this chunk's logits and teacher probabilities
        s + FP32 + (s if multi else 0) + copy32 + FP32,  # the fp32 log-softmax of the logits
        s + FP32 + FP32 + (0 if d.fp32 else s),  # the fp32 logit gradient and its cast
    )
    head_grad = d.N_d * d.H * (s + copy32)
    return rows + max(C * d.N_d * coefficient, C * d.N_d * (2 * s + FP32) + head_grad)


def chunked_loss_backward_ws(d: DraftDims, k: int, head_in_flight: int) -> int:
    """``FusedHeadSoftCE.backward`` of step ``k``: the ``[B,T,H]`` hidden gradient (zero-filled, written chunk by
    chunk) and the fp32 ``lm_head`` gradient accumulator ``[N_d,H]`` live through the chunk loop
    (:func:`chunked_chunk_ws`); on return the accumulator's cast to the draft dtype, then autograd adds it to the
    unrolled gradient (``head_in_flight``)."""
    grad_h, grad_w32 = d.BT * d.H * d.s, d.N_d * d.H * FP32
    loop = grad_w32 + chunked_chunk_ws(d, k, backward=True)
    returned = max(grad_w32 + d.N_d * d.H * d.s, head_in_flight)
    return grad_h + max(loop, returned)


def mlp_backward_ws(d: DraftDims) -> int:
    """SiTU backward: the ``down_proj`` input gradient (draft dtype) and two fp32 ``[B,T,I]`` gradients at once."""
    return (d.s + 2 * FP32) * d.BT * d.I


def diagonal_chunk(d: DraftDims) -> int:
    """Elements per head dimension of one slot chunk of the expanded ``flash_lse`` diagonal: ``B·(n/sp)·C`` with
    ``C = min(DEFAULT_DIAGONAL_CHUNK, T_keys)`` (the attention runs on the rank's heads over every slot)."""
    return d.B * (d.n // d.sp) * min(ttt_attention.DEFAULT_DIAGONAL_CHUNK, d.T_keys)


def diagonal_backward_ws(d: DraftDims, k: int, returned: int) -> int:
    """``_LSEMergedTTTAttention.backward``'s diagonal part (``draft/ttt_attention.py``), after the block kernel:
    its returned ``dq, dK_0, dV_0`` (``returned``) and the later steps' gradients ``k·[B,n,T,d_qk+d_v]`` in the draft
    dtype (allocated at once, filled chunk by chunk), plus one slot chunk's temporaries — the later K/V of the chunk
    in fp32 ``k·[B,n,C,d_qk+d_v]`` (while V's draft-dtype stack is cast), the fp32 ``q``/``dO`` rows, the fp32
    ``dq`` rows with the diagonal part and its scaled copy, the ``[B,n,C,k]`` probabilities and score gradients."""
    c, f = diagonal_chunk(d), FP32
    cast, copy32 = (0, 0) if d.fp32 else (d.s, FP32)
    rows = k * c * (d.d_qk + d.d_v) * f + c * (d.d_qk + d.d_v) * copy32 + c * d.d_qk * (2 * f + copy32) + 2 * c * k * f
    stacking = k * c * (d.d_qk * f + d.d_v * (cast + f))
    return returned + k * d.BT * d.n * (d.d_qk + d.d_v) * d.s + max(rows, stacking)


def attention_backward_ws(d: DraftDims, k: int) -> int:
    """Backward of step ``k``'s TTT attention (``_LSEMergedTTTAttention.backward`` / eager autograd).

    ``flash_lse``: the block kernel's backward — on CUDA the chunked kernel holds fp32 ``k, v`` copies, fp32
    ``dq, dk, dv`` and six fp32 ``[B,n,256,T]`` score tiles; the fused CPU kernel pads grad/q/k/v/out to one width
    and returns padded grads — or the slot-chunked diagonal part after it (:func:`diagonal_backward_ws`): no
    ``[k,B,n,T,·]`` fp32 stack. ``eager``: the gradients of the ``[B,n,T,T+k]`` probabilities (see below) and the
    stacked later-step K/V gradients."""
    BTn = d.BT * d.n
    if d.concatenated:  # the kernel's dK/dV over the concatenated keys and an fp32 dq accumulator (analytic)
        return (k + 1) * BTn * (d.d_qk + d.d_v) * d.s + BTn * d.d_qk * (d.s + FP32)
    if d.backend == "eager":
        # The two slices' zero-filled gradients and the block matmul's gradient (3 in the draft dtype), or later the
        # summed gradient with its fp32 copy and the fp32 softmax backward.
        probs = d.B * d.n * d.T * (d.T_keys + k)
        return probs * max(3 * d.s, d.s + 2 * FP32) + k * BTn * (d.d_qk + d.d_v) * d.s
    kernel = 6 * BTn * max(d.d_qk, d.d_v) * d.s if d.cpu else chunked_kernel_backward_ws(d)
    if d.latent:
        return latent_attention_backward_ws(d, k, kernel)
    if k == 0:
        return kernel
    # The fused CPU kernel's grads are views of its padded [B,n,T,max(d_qk,d_v)] results.
    returned = BTn * (3 * max(d.d_qk, d.d_v) if d.cpu else 2 * d.d_qk + d.d_v) * d.s
    return max(kernel, diagonal_backward_ws(d, k, returned))


def chunked_kernel_backward_ws(d: DraftDims) -> int:
    """``ChunkedKernel.backward`` (``draft/block_attention.py``, the CUDA block kernel) on ``[B,n/sp,T_keys,·]``:
    fp32 copies of ``k, v`` (not in fp32), fp32 ``dq, dk, dv`` and ``D``, then at the last 256-query chunk the masked
    scores, ``S − lse`` and its exp (three fp32 ``[B,n,256,T]`` tiles) while the previous chunk's probabilities,
    ``dP``, ``dS`` (``[B,n,256,T−256]``) and fp32 ``dO`` rows are still referenced — or the chunk's ``dK``
    contribution and its scaled copy ``[B,n,T,d_qk]``; at the end the casts of the grads beside the fp32 ones."""
    BTn, f = d.BT * d.n, FP32
    copy32 = 0 if d.fp32 else FP32
    Cq, heads = min(256, d.T_keys), d.n // d.sp
    tile, previous = d.B * heads * Cq * d.T_keys * f, d.B * heads * Cq * (d.T_keys - Cq) * f
    fixed = BTn * ((d.d_qk + d.d_v) * copy32 + (2 * d.d_qk + d.d_v + 1) * f)
    loop = 3 * tile + max(3 * previous + d.B * heads * Cq * d.d_v * copy32, 2 * BTn * d.d_qk * f)
    end = 3 * tile + (0 if d.fp32 else BTn * (2 * d.d_qk + d.d_v) * d.s)
    return fixed + max(loop, end)


def attention_forward_ws(d: DraftDims, k: int) -> int:
    """Peak of step ``k``'s expanded ``flash_lse`` forward beyond its inputs, its output and LSE included (0 for the
    other backends and the latent cache, whose transients are not modelled here).

    The block kernel: on CUDA the chunked kernel's last 256-query chunk — its fp32 scores, the two logsumexp
    temporaries and the previous chunk's probabilities (``[B,n,256,T]`` fp32 each), the chunk outputs and LSEs so far,
    or at the end those lists beside their concatenation; the fused CPU kernel: the padded inputs and its padded
    output ``[B,n,T,max(d_qk,d_v)]`` and LSE. For ``k ≥ 1`` then the slot-chunked diagonal merge: the block output
    and LSE, the merged ones, and one chunk's later K (or V) stacked in the draft dtype and in fp32
    (``k·[B,n,C,d]``) beside the fp32 ``q`` rows (or the merged output rows)."""
    if d.backend != "flash_lse" or d.latent:
        return 0
    BTn, s, f = d.BT * d.n, d.s, FP32
    width = max(d.d_qk, d.d_v)
    if d.cpu:
        pads = BTn * width * s * ((d.d_qk < width) * 2 + (d.d_v < width))
        block_out = BTn * (width * s + f)
        kernel = pads + block_out
    else:
        Cq, heads = min(256, d.T_keys), d.n // d.sp
        tiles = d.B * heads * Cq * (3 * d.T_keys + d.T_keys - Cq) * f
        block_out = BTn * (d.d_v * s + f)
        kernel = max(tiles + d.B * heads * (d.T_keys - Cq) * (d.d_v * s + f), 2 * block_out)
    if k == 0:
        return kernel
    c = diagonal_chunk(d)
    cast = 0 if d.fp32 else s
    # fp32 q rows: a cast copy, or the contiguous copy matmul makes of a strided slice (none for one whole chunk)
    q_rows = 0 if d.fp32 and c == BTn else c * d.d_qk * f
    rows = max(k * c * d.d_qk * (f + cast) + q_rows, k * c * d.d_v * (f + cast) + 3 * c * d.d_v * f)
    return max(kernel, block_out + BTn * (d.d_v * s + f) + rows)


def latent_attention_backward_ws(d: DraftDims, k: int, kernel: int) -> int:
    """``flash_lse`` over a latent cache (``draft/latent_attention.py``): the block kernel's backward on the
    expanded ``K_0``/``V_0`` (``kernel``); then, for ``k ≥ 1``, ``_LatentLSEMergedTTTAttention.backward``'s diagonal
    part — beside the kernel's returned grads, the fp32 ``dq``, ``W_kv`` copy and gradient ``[n,d_nope+d_v,r]``, the
    later latents' and rope keys' fp32 gradients ``[k,B,T,r+d_rope]``, and per slot chunk the re-expanded later
    ``K_i``/``V_i``, their gradients and the chunk's fp32 ``q``/``dO``/``dq`` (``k·[B,n,C,·]``, fp32); finally the
    step-0 block's expansion backward: the ``[B,T,n·(d_nope+d_v)]`` gradient of the ``kv_b_proj`` output, assembled
    from ``dK_0``/``dV_0``."""
    BTn, s = d.BT * d.n, d.s
    returned = BTn * (2 * d.d_qk + d.d_v) * s
    expansion = returned + d.BT * d.n * (d.d_nope + d.d_v) * s
    if k == 0:
        return max(kernel, expansion)
    C = min(ttt_attention.DEFAULT_DIAGONAL_CHUNK, d.T)
    copy32 = 0 if d.fp32 else FP32
    w = d.n * (d.d_nope + d.d_v) * d.kv_lora
    held = returned + BTn * d.d_qk * copy32 + w * (copy32 + FP32) + k * d.BT * (d.kv_lora + d.d_rope) * FP32
    later = k * d.B * d.n * C * FP32 * (2 * d.d_qk + 2 * (d.d_nope + d.d_v) + d.d_v)
    chunk = later + d.B * d.n * C * FP32 * (2 * d.d_qk + d.d_v) + w * FP32 + k * d.B * C * (d.kv_lora + d.d_rope) * FP32
    return max(kernel, held + chunk, expansion)


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
    """The forward's own peak: the last step's SiTU, before its final norm and loss exist; the cache list, whose
    entries the unroll drops on return where no tensor saved them (``eager``'s later K/V, a latent entry's rope
    key), is still alive. With the chunked loss, also the last step's loss chunk (:func:`chunked_chunk_ws`)."""
    # The cache list's entries beyond what is saved of them (none when checkpointed: every entry is kept).
    listed = [0 if checkpointing else cache_entry_bytes(d) - cache_entry_kept(d, k, False) for k in range(d.K)]
    held = shared + sum(kept) + sum(listed)
    last = d.K - 1
    peak = held - loss_saved(d, last) - final_norm_saved(d) + situ_forward_ws(d, not checkpointing)
    if d.chunked:
        peak = max(peak, held + chunked_chunk_ws(d, last, backward=False))
    # The last step's input exchange and attention: its layer holds only the norms and projections so far.
    if checkpointing:  # a first (no-grad) forward saves nothing: its input, `combined` and q are held
        step = d.BT * (d.H + 2 * d.H + d.n * d.d_qk) * d.s
    else:
        parts = step_saved_parts(d, last)
        step = parts["norms"] - norm_saved(d, d.H) + parts["attention projections"]
    before = shared + sum(kept[:last]) + sum(listed[:last]) + step
    if d.sp > 1:
        peak = max(peak, before + exchange_forward_ws(d))
    return max(peak, before + cache_entry_bytes(d) + attention_forward_ws(d, last))


def exchange_forward_ws(d: DraftDims) -> int:
    """Ulysses (``parallel/sequence_parallel.py`` ``sequence_to_head_shards``) at one step, beyond what the step
    keeps: the token-layout ``k`` and ``kv_b`` output (``v`` is its view; under SP nothing saves either once the
    head-sharded copies exist), the packed send buffer ``[sp,B,n/sp,T/sp,2·d_qk+d_v]`` and the received one, and the
    head-sharded ``q, k, v`` ``[B,n/sp,T,·]`` cut from it — the same bytes as ``[B,n,T/sp,·]`` — while the
    token-layout ``q`` (counted by the step) is still referenced. The output's inverse exchange (a contiguous send
    copy and the receive buffer, ``[B,n,T/sp,d_v]`` each) is smaller."""
    if d.sp == 1:
        return 0
    BTn, packed = d.BT * d.n, 2 * d.d_qk + d.d_v
    return BTn * d.s * (d.d_qk + d.d_nope + d.d_v + 2 * packed + packed)


def exchange_backward_ws(d: DraftDims) -> int:
    """The exchanges' adjoints in the backward of one step: after the attention backward, the head-sharded
    ``dq, dk, dv`` packed into one buffer and its exchange (``_AllToAll.backward``: the same all-to-all), then the
    token-layout gradients copied out of it — two packed ``[B,n,T/sp,2·d_qk+d_v]`` buffers at a time (the output's
    adjoint, ``[B,n,T/sp,d_v]`` ×3, comes before the attention backward and is smaller)."""
    if d.sp == 1:
        return 0
    return 2 * d.BT * d.n * (2 * d.d_qk + d.d_v) * d.s


def cache_grad_bytes(d: DraftDims) -> int:
    """The gradient of one cached entry, waiting in a buffer until its step is back-propagated: per-head K/V
    ``[B,n,T,d_qk+d_v]``, or a latent entry's ``[B,1,T,r]`` + ``[B,1,T,d_rope]``."""
    if d.latent:
        return d.BT * (d.kv_lora + d.d_rope) * d.s
    return d.BT * d.n * (d.d_qk + d.d_v) * d.s


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
    final_norm = parts["final norm"]
    buffers = 0 if first else shapes.unrolled * s + (j + 1) * cache_grad_bytes(d)
    live = shared + sum(kept[: j + 1]) + buffers
    if d.chunked:
        stages = {"loss / lm_head": live + chunked_loss_backward_ws(d, j, in_flight("head"))}
    else:
        logits_grad = d.B * d.T * d.N_d * s
        stages = {"loss / lm_head": live + max(loss_backward_ws(d, j), logits_grad + in_flight("head"))}
    live += created("head") - loss_saved(d, j) - final_norm
    if checkpointing:  # the step's forward again, saving this time, with a second copy of its K/V
        projected = live + parts["norms"] - norm_saved(d, d.H) + parts["attention projections"]
        if d.sp > 1:
            stages["recompute exchange"] = projected + exchange_forward_ws(d)
        stages["recompute attention"] = projected + cache_entry_bytes(d) + attention_forward_ws(d, j)
        live += sum(parts.values()) - parts["loss"] - final_norm + cache_entry_bytes(d)
        stages["recompute"] = live + situ_forward_ws(d, saved=True)
    stages["MLP"] = live + max(d.BT * d.I * s + in_flight("mlp"), mlp_backward_ws(d))
    live += created("mlp") - parts["SiTU MLP"] - norm_saved(d, d.H) - parts["attention output"]
    live += created("attention output")
    stages["attention"] = live + attention_backward_ws(d, j)
    if d.sp > 1:
        stages["attention exchange"] = live + exchange_backward_ws(d)
    return {f"{stage} backward of step {j}": value for stage, value in stages.items()}


def unroll_peak(d: DraftDims, checkpointing: bool, shared: int, shapes: DraftShapes) -> UnrollPeak:
    """The draft unroll's peak over its forward and a backward followed step by step (``j = K−1 … 0``; autograd
    back-propagates the last step first). The last candidate is ``fc``'s gradient, once per unroll, at the end."""
    kept = [step_kept(d, k, checkpointing) for k in range(d.K)]
    stages = {"last step forward": last_step_forward(d, checkpointing, shared, kept)}
    # Without checkpointing nothing holds the cache (and eager's mask with it) once the unroll returns.
    shared -= 0 if checkpointing else eager_mask_bytes(d)
    for j in reversed(range(d.K)):
        stages.update(step_backward_stages(d, j, checkpointing, shared, kept, shapes))
    stages["fc backward"] = shared + kept[0] + (shapes.unrolled + shapes.projection) * d.s
    where = max(stages, key=stages.__getitem__)
    return UnrollPeak(kept_after_forward=shared + sum(kept), peak=stages[where], where=where, stages=stages)
