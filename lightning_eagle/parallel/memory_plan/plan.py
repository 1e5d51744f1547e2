"""The plan: each phase's terms, summed into a :class:`MemoryPlan` whose peak is ``resident + max over phases``
(:func:`build_plan`)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_eagle.parallel.memory import TargetShapes, routed_bytes, target_shapes
from lightning_eagle.parallel.memory_plan.draft_backward import unroll_peak
from lightning_eagle.parallel.memory_plan.draft_forward import DraftDims, cache_entry_kept, unroll_shared_saved
from lightning_eagle.parallel.memory_plan.draft_shapes import DraftShapes, shapes_of
from lightning_eagle.parallel.memory_plan.dspark_plan import dspark_terms
from lightning_eagle.parallel.memory_plan.inputs import FP32, PHASES, RESIDENT, PlanInputs, dtype_name
from lightning_eagle.parallel.memory_plan.target_forward import target_forward_peak
from lightning_eagle.parallel.memory_plan.terms import Term, gb, shard


@dataclass(frozen=True)
class MemoryPlan:
    """Every term of one rank's plan; the peak is the resident bytes plus the largest phase."""

    inputs: PlanInputs
    terms: tuple[Term, ...]

    def phase_bytes(self, phase: str) -> int:
        return sum(t.nbytes for t in self.terms if t.phase == phase)

    @property
    def resident_bytes(self) -> int:
        return self.phase_bytes(RESIDENT)

    @property
    def peak_phase(self) -> str:
        return max(self.inputs.phases, key=self.phase_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.phase_bytes(self.peak_phase)

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)


def resident_terms(inputs: PlanInputs, target: TargetShapes, draft: DraftShapes) -> list[Term]:
    c, t_dt, s = inputs.target, inputs.target_dtype, inputs.draft_dtype.itemsize
    experts = c.num_experts // inputs.ep
    full = target.dense_bytes(t_dt)
    dense_note = (
        f"FSDP2 shards over {inputs.world} ranks (full copy {gb(full)})" if inputs.dense_sharded else "replicated"
    )
    storage = "MXFP4 packed" if inputs.expert_storage == "mxfp4" else f"dequantised {dtype_name(t_dt)}"
    trainable = shard(draft.trainable, inputs)
    sharded = f", sharded over {inputs.world}" if inputs.draft_shard else ""
    terms = [
        Term(RESIDENT, "target dense weights", target.dense_held_bytes(t_dt, inputs.world, inputs.dense_sharded),
             dense_note),
        Term(RESIDENT, "target routed experts",
             routed_bytes(target.routed_weights_per_expert * experts, t_dt, inputs.expert_storage),
             f"{experts} experts/layer at expert_parallel_size {inputs.ep}, {storage}"),
        Term(RESIDENT, "draft parameters", (trainable + draft.frozen) * s + draft.buffer_bytes,
             f"{draft.trainable / 1e9:.3g} B trainable{sharded}"
             + (f" + {draft.frozen / 1e9:.3g} B frozen embedding" if draft.frozen else "")
             + f", {dtype_name(inputs.draft_dtype)}"),
        Term(RESIDENT, "AdamW states", 2 * trainable * s,
             f"exp_avg + exp_avg_sq in the parameter dtype ({dtype_name(inputs.draft_dtype)}; no fp32 master copy)"),
    ]  # fmt: skip
    if inputs.accumulate_grad_batches > 1:
        terms.append(Term(RESIDENT, "gradients between micro-batches", trainable * s,
                          f"accumulate_grad_batches={inputs.accumulate_grad_batches}"))  # fmt: skip
    terms.append(Term(RESIDENT, "runtime reserve", inputs.reserve_bytes,
                      "assumption: CUDA context, NCCL buffers, allocator fragmentation"))  # fmt: skip
    return terms


def target_forward_terms(inputs: PlanInputs, target: TargetShapes) -> list[Term]:
    phase = PHASES[0]
    peak = target_forward_peak(inputs, target)
    where = {-1: "the embedding", inputs.target.num_hidden_layers: "the output mixer"}.get(peak.index)
    where = where or f"layer {peak.index}"
    terms = [
        Term(phase, "residual stream, AttnRes bank, aux taps", peak.stream, f"at {where}"),
        Term(phase, "layer working set", peak.working_set, f"{peak.kind} of {where}"
             + (f"; {peak.moe_note}" if peak.moe_note and "MoE" in peak.kind else "")),
    ]  # fmt: skip
    if inputs.dense_sharded:
        terms.append(Term(phase, "dense weights gathered (FSDP2)", peak.gathers, gather_note(inputs, target, where)))
    return terms


def gather_note(inputs: PlanInputs, target: TargetShapes, where: str) -> str:
    """Which FSDP2 gather dominates: the running unit + the prefetched next one (largest adjacent pair), the
    embedding (with layer 0 prefetched) or the teacher's ``lm_head`` (its own phase)."""
    dt = inputs.target_dtype
    units = [target.embedding, *target.layers]
    pairs = [
        (units[i].nbytes(dt) + units[i + 1].nbytes(dt), units[i].name, units[i + 1].name) for i in range(len(units) - 1)
    ]
    size, first, second = max(pairs)
    head = target.lm_head.nbytes(dt)
    return (
        f"running unit + prefetched next at {where}; largest pair {first} + {second} {gb(size)}, "
        f"lm_head {gb(head)} (teacher phase)"
    )


def target_outputs_bytes(inputs: PlanInputs) -> int:
    """The capture's ``[B,T,3H]`` aux states and post-norm final hidden, plus the shifted copy of the hidden that
    ``shared_step`` hands to the unroll; alive through the teacher and the whole unroll."""
    N, H = inputs.batch_size * inputs.seq_len, inputs.target.hidden_size
    return (3 + 2) * N * H * inputs.target_dtype.itemsize


def teacher_rows(inputs: PlanInputs) -> int:
    """Rows the teacher is built on: the batch, or under draft sequence parallelism this rank's window of slots
    (its ``T/sp`` slots and the ``K−1`` rows after them that its later TTT steps read)."""
    if inputs.draft_sp == 1:
        return inputs.batch_size * inputs.seq_len
    return inputs.batch_size * min(inputs.local_seq_len + inputs.ttt_steps - 1, inputs.seq_len)


def teacher_terms(inputs: PlanInputs, target: TargetShapes) -> list[Term]:
    """``training/teacher.py``: per ``seq_chunk × vocab_chunk`` tile the logits in the target dtype, their fp32 copy
    and the draft columns. ``teacher_from_hidden`` (plain loss) keeps fp32 ``[B·T, N_d]`` draft-vocab logits, then
    their softmax; ``chunked_teacher_from_hidden`` (chunked loss) keeps only ``top``/``draft_argmax`` (int64) and
    ``pos`` per row and ``lm_head.weight[selected]`` ``[N_d, H_t]``, its per-chunk draft logits and softmax being
    transient."""
    phase = PHASES[1]
    N, V, N_d = teacher_rows(inputs), inputs.target.vocab_size, inputs.draft.draft_vocab_size
    H_t, st = inputs.target.hidden_size, inputs.target_dtype.itemsize
    rows, cols = min(inputs.teacher_seq_chunk, N), min(inputs.teacher_vocab_chunk, V)
    tile = rows * cols * (st + FP32) + rows * min(cols, N_d) * FP32
    terms = [Term(phase, "target outputs (aux states, final hidden)", target_outputs_bytes(inputs))]
    if inputs.loss_backend == "chunked":
        chunk = rows * N_d * FP32 * 2  # the chunk's draft logits and their softmax (for draft_argmax)
        kept = N * (8 + 8 + 1) + N_d * H_t * st
        terms.append(Term(phase, "chunked teacher + chunk tile", kept + chunk + tile + V * 8,
                          f"top, draft argmax, pos per row + lm_head[selected] [N_d,H_t] {gb(N_d * H_t * st)}; "
                          f"tile {rows}×{cols}"))  # fmt: skip
    else:
        logits = N * N_d * FP32
        terms.append(Term(phase, "teacher logits + softmax / chunk tile", logits + max(tile, logits) + V * 8,
                          f"[B,T,N_d] fp32 ×2 (tile {rows}×{cols}: {gb(tile)})"))  # fmt: skip
    if inputs.dense_sharded and target.lm_head.params:
        terms.append(Term(phase, "lm_head gathered for the teacher", target.lm_head.nbytes(inputs.target_dtype)))
    return terms


def teacher_kept_bytes(inputs: PlanInputs) -> tuple[int, str]:
    """What the teacher keeps through the unroll: fp32 ``[B,T,N_d]`` probabilities with ``pos``/``top``, or the
    chunked teacher's per-row ids and ``lm_head.weight[selected]``."""
    N, N_d = teacher_rows(inputs), inputs.draft.draft_vocab_size
    if inputs.loss_backend == "chunked":
        return N * (8 + 8 + 1) + N_d * inputs.target.hidden_size * inputs.target_dtype.itemsize, "chunked teacher"
    return N * N_d * FP32 + N * 9, "teacher probs [B,T,N_d] fp32"


def draft_unroll_terms(inputs: PlanInputs, draft: DraftShapes) -> list[Term]:
    phase = PHASES[2]
    d = DraftDims.of(inputs)
    ckpt = inputs.activation_checkpointing
    shared = unroll_shared_saved(d, inputs.target_dtype, inputs.draft_dtype)
    up = unroll_peak(d, ckpt, shared, draft)
    cache = sum(cache_entry_kept(d, k, ckpt) for k in range(d.K))
    teacher_bytes, teacher_note = teacher_kept_bytes(inputs)
    kept_outside = "final norms, log-probs" if inputs.loss_backend == "plain" else "the chunked loss's step outputs"
    saved_note = f"checkpointed: step inputs, {kept_outside}" if ckpt else "what autograd saves per step"
    shared_note = {"eager": "eager's [B,1,T,T] additive mask", "flash_lse": "no mask (flash_lse: CausalBlock)"}.get(
        d.backend, f"no mask held across steps ({d.backend}: each step's, in its attention core)"
    )
    if inputs.target_dtype != inputs.draft_dtype:
        shared_note += ", fc input cast to the draft dtype"
    terms = [
        Term(phase, "target outputs + teacher", target_outputs_bytes(inputs) + teacher_bytes,
             f"aux, final hidden ×2, {teacher_note}"),
        Term(phase, "TTT K/V cache", cache, f"{d.K} steps"),
        Term(phase, "TTT saved activations", up.kept_after_forward - cache - shared,
             f"{saved_note}; {d.K} steps at T={d.T}, backend {d.backend}"),
        Term(phase, "TTT mask + fc input cast", shared, shared_note),
        Term(phase, "backward: gradient buffers + working set", up.peak - up.kept_after_forward,
             f"peak at {up.where}"),
    ]  # fmt: skip
    if inputs.draft_shard:
        gathered = (draft.trainable - shard(draft.trainable, inputs)) * d.s
        terms.append(Term(phase, "draft parameters gathered (FSDP2)", gathered))
    return terms


def optimizer_terms(inputs: PlanInputs, draft: DraftShapes) -> list[Term]:
    """AdamW: the CUDA default (foreach) takes ``sqrt(exp_avg_sq)`` of every parameter at once; the CPU default
    (single tensor) one parameter at a time (the sqrt and its quotient). The module's grad-norm logging copies one
    gradient at a time to fp32 before the step."""
    phase = PHASES[3]
    s = inputs.draft_dtype.itemsize
    trainable = shard(draft.trainable, inputs)
    largest = shard(draft.largest_trainable, inputs)
    foreach = trainable * s if inputs.device != "cpu" else 2 * largest * s
    terms = [Term(phase, "optimizer temporaries", max(foreach, largest * FP32),
                  "foreach AdamW: sqrt(exp_avg_sq) of every parameter" if inputs.device != "cpu" else
                  "single-tensor AdamW")]  # fmt: skip
    if inputs.accumulate_grad_batches == 1:
        terms.append(Term(phase, "gradients", trainable * s))
    return terms


def build_plan(inputs: PlanInputs, target: TargetShapes | None = None, draft: DraftShapes | None = None) -> MemoryPlan:
    """The per-rank plan of ``inputs``; pass precomputed shapes when planning many layouts of one run."""
    target = target or target_shapes(inputs.target)
    draft = draft or shapes_of(inputs.draft)
    if inputs.family == "dspark":
        family = dspark_terms(inputs, target, draft)
    else:
        family = [*teacher_terms(inputs, target), *draft_unroll_terms(inputs, draft)]
    terms = [
        *resident_terms(inputs, target, draft),
        *target_forward_terms(inputs, target),
        *family,
        *optimizer_terms(inputs, draft),
    ]
    return MemoryPlan(inputs, tuple(terms))
