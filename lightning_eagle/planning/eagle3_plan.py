"""The EAGLE-3 family's memory plan: its phases (the teacher, the K-step TTT unroll between the target forward and the
optimizer step), their terms, the header line, what the plan does not model for it, and its
:class:`~lightning_eagle.planning.family.PlanningFamily` record.

The unroll's terms are derived from the code of its forward and backward (:mod:`.eagle3_unroll_forward`,
:mod:`.eagle3_unroll_backward`: each function names the tensors it counts and why they are alive); the tests hold them
against a census of the real unroll on the meta device (:mod:`lightning_eagle.planning.census`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.draft.export import EAGLE3
from lightning_eagle.parallel.memory import TargetShapes
from lightning_eagle.planning.draft_shapes import DraftShapes
from lightning_eagle.planning.eagle3_shapes import eagle3_draft_shapes
from lightning_eagle.planning.eagle3_unroll_backward import unroll_peak
from lightning_eagle.planning.eagle3_unroll_forward import (
    DraftDims,
    cache_entry_kept,
    ttt_attention_backend,
    unroll_shared_saved,
)
from lightning_eagle.planning.family import PlanningFamily, register_planning_family
from lightning_eagle.planning.inputs import PlanInputs
from lightning_eagle.planning.terms import FP32, OPTIMIZER_STEP, TARGET_FORWARD, Term, dtype_name, gb, shard
from lightning_eagle.run_settings import check_draft_sequence_parallel

EAGLE3_PHASES = (TARGET_FORWARD, "teacher", "draft unroll", OPTIMIZER_STEP)
_UNMODELLED = {"architecture": "k3", "fc_norm": False, "norm_output": False}  # draft fields the plan models only so


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
    return inputs.batch_size * min(inputs.local_seq_len + inputs.objective.ttt_steps - 1, inputs.seq_len)


def teacher_terms(inputs: PlanInputs, target: TargetShapes) -> list[Term]:
    """``training/teacher.py``: per ``seq_chunk × vocab_chunk`` tile the logits in the target dtype, their fp32 copy
    and the draft columns. ``teacher_from_hidden`` (plain loss) keeps fp32 ``[B·T, N_d]`` draft-vocab logits, then
    their softmax; ``chunked_teacher_from_hidden`` (chunked loss) keeps only ``top``/``draft_argmax`` (int64) and
    ``pos`` per row and ``lm_head.weight[selected]`` ``[N_d, H_t]``, its per-chunk draft logits and softmax being
    transient."""
    phase = EAGLE3_PHASES[1]
    N, V, N_d = teacher_rows(inputs), inputs.target.vocab_size, inputs.draft.draft_vocab_size
    H_t, st = inputs.target.hidden_size, inputs.target_dtype.itemsize
    rows, cols = min(inputs.objective.teacher_seq_chunk, N), min(inputs.objective.teacher_vocab_chunk, V)
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
    phase = EAGLE3_PHASES[2]
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


def eagle3_terms(inputs: PlanInputs, target: TargetShapes, draft: DraftShapes) -> list[Term]:
    """The teacher's and the draft unroll's terms."""
    return [*teacher_terms(inputs, target), *draft_unroll_terms(inputs, draft)]


def check_eagle3(inputs: PlanInputs) -> None:
    """What the plan refuses for an EAGLE-3 run: what draft sequence parallelism refuses (the module's own check), a
    draft layer other than the K3-faithful one without ``fc_norm`` / ``norm_output``."""
    check_draft_sequence_parallel(
        inputs.draft_sp, num_attention_heads=inputs.draft.num_attention_heads, draft=inputs.draft_settings,
        target_source=inputs.target_settings.source,
    )  # fmt: skip
    for name, value in _UNMODELLED.items():
        if getattr(inputs.draft, name) != value:
            value = getattr(inputs.draft, name)
            raise ValueError(f"model.draft.config.{name}={value!r} is not modelled by the memory plan")


def describe_eagle3(inputs: PlanInputs) -> str:
    i, ckpt = inputs, "on" if inputs.draft_settings.activation_checkpointing else "off"
    return (
        f"micro-batch {i.batch_size} x {i.seq_len} tokens, ttt_steps {i.objective.ttt_steps}, attention "
        f"{ttt_attention_backend(i)}, activation checkpointing {ckpt}, target {dtype_name(i.target_dtype)} "
        f"({i.expert_storage} experts), draft {dtype_name(i.draft_dtype)}, N_d {i.draft.draft_vocab_size}"
    )


def draft_for_data(draft: Eagle3DraftConfig, data: Mapping[str, Any]) -> Eagle3DraftConfig:
    """The draft vocabulary is the data module's (``draft_vocab_size``: the vocabulary map the module builds the draft
    with); None keeps the whole target vocabulary."""
    return dataclasses.replace(draft, draft_vocab_size=data.get("draft_vocab_size"))


EAGLE3_PLAN = register_planning_family(PlanningFamily(
    name=EAGLE3, phases=EAGLE3_PHASES, draft_shapes=eagle3_draft_shapes, check=check_eagle3, step_terms=eagle3_terms,
    describe=describe_eagle3, draft_for_data=draft_for_data,
))  # fmt: skip
