"""The plan: each phase's terms, summed into a :class:`MemoryPlan` whose peak is ``resident + max over phases``
(:func:`build_plan`). The terms every family shares are made here (the resident weights and optimizer states, the
target's no-grad capture, the optimizer step); the family's own phases come from its
:class:`~lightning_eagle.planning.family.PlanningFamily` (``step_terms``)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_eagle.parallel.memory import TargetShapes, routed_bytes, target_shapes
from lightning_eagle.planning.draft_shapes import DraftShapes
from lightning_eagle.planning.family import planning_family
from lightning_eagle.planning.inputs import PlanInputs
from lightning_eagle.planning.target_forward import target_forward_peak
from lightning_eagle.planning.terms import FP32, OPTIMIZER_STEP, RESIDENT, TARGET_FORWARD, Term, dtype_name, gb, shard


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
        Term(RESIDENT, "draft parameters", trainable * inputs.stored_bytes + draft.frozen * s + draft.buffer_bytes,
             f"{draft.trainable / 1e9:.3g} B trainable{sharded}"
             + (f" + {draft.frozen / 1e9:.3g} B frozen embedding" if draft.frozen else "")
             + (f", fp32 shards computing in {dtype_name(inputs.draft_dtype)}" if inputs.stored_bytes != s
                else f", {dtype_name(inputs.draft_dtype)}")),
    ]  # fmt: skip
    stepped, zero = stepped_numel(inputs, draft), partitioned_note(inputs)
    if inputs.master_weights and not inputs.draft_shard:
        terms.append(Term(RESIDENT, "fp32 master weights", stepped * FP32,
                          "the optimizer's fp32 copy of the trained parameters (MasterWeights)" + zero))  # fmt: skip
    terms.append(Term(RESIDENT, "AdamW states", 2 * stepped * inputs.state_bytes,
                      "exp_avg + exp_avg_sq in fp32" if inputs.master_weights else
                      f"exp_avg + exp_avg_sq in the parameter dtype ({dtype_name(inputs.draft_dtype)}; no fp32 master "
                      "copy)"))  # fmt: skip
    if inputs.accumulate_grad_batches > 1:
        terms.append(Term(RESIDENT, "gradients between micro-batches", trainable * inputs.stored_bytes,
                          f"accumulate_grad_batches={inputs.accumulate_grad_batches}"))  # fmt: skip
    terms.append(Term(RESIDENT, "runtime reserve", inputs.reserve_bytes,
                      "assumption: CUDA context, NCCL buffers, allocator fragmentation"))  # fmt: skip
    return terms


def target_forward_terms(inputs: PlanInputs, target: TargetShapes) -> list[Term]:
    phase = TARGET_FORWARD
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


def stepped_numel(inputs: PlanInputs, draft: DraftShapes) -> int:
    """Elements of the trained parameters whose optimizer states (and fp32 masters) one rank holds: its shard of a
    sharded draft; of a replicated draft with masters over several ranks, its partition (whole tensors, largest first
    to the least loaded rank: at most the mean plus the largest tensor); else all of them."""
    if inputs.masters_partitioned:
        return min(draft.trainable, -(-draft.trainable // inputs.world) + draft.largest_trainable)
    return shard(draft.trainable, inputs)


def partitioned_note(inputs: PlanInputs) -> str:
    if inputs.masters_partitioned:
        return f", partitioned over {inputs.world} ranks (at most the mean + the largest tensor)"
    return ""


def optimizer_terms(inputs: PlanInputs, draft: DraftShapes) -> list[Term]:
    """AdamW: the CUDA default (foreach) takes ``sqrt(exp_avg_sq)`` of every parameter at once; the CPU default
    (single tensor) one parameter at a time (the sqrt and its quotient). The module's grad-norm logging copies one
    gradient at a time to fp32 before the step."""
    phase = OPTIMIZER_STEP
    s, g = inputs.state_bytes, inputs.stored_bytes
    trainable, stepped = shard(draft.trainable, inputs), stepped_numel(inputs, draft)
    largest = shard(draft.largest_trainable, inputs)
    foreach = stepped * s if inputs.device != "cpu" else 2 * largest * s
    terms = [Term(phase, "optimizer temporaries", max(foreach, largest * FP32),
                  "foreach AdamW: sqrt(exp_avg_sq) of every parameter" if inputs.device != "cpu" else
                  "single-tensor AdamW")]  # fmt: skip
    if inputs.accumulate_grad_batches == 1:
        terms.append(Term(phase, "gradients", trainable * g))
    if inputs.master_weights and not inputs.draft_shard:
        terms.append(Term(phase, "fp32 gradients of the masters", stepped * FP32,
                          "MasterWeights hands the inner optimizer fp32 copies of its gradients"))  # fmt: skip
    return terms


def build_plan(inputs: PlanInputs, target: TargetShapes | None = None, draft: DraftShapes | None = None) -> MemoryPlan:
    """The per-rank plan of ``inputs``; pass precomputed shapes when planning many layouts of one run."""
    family = planning_family(inputs.family)
    target = target or target_shapes(inputs.target)
    draft = draft or family.draft_shapes(inputs.draft)
    terms = [
        *resident_terms(inputs, target, draft),
        *target_forward_terms(inputs, target),
        *family.step_terms(inputs, target, draft),
        *optimizer_terms(inputs, draft),
    ]
    return MemoryPlan(inputs, tuple(terms))
