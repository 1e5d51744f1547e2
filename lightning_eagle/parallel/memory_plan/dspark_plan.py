"""The terms of a DSpark run's plan (:func:`dspark_terms`): the phases are the target's no-grad forward (shared with
EAGLE-3), the teacher head (a dense-sharded target's whole ``lm_head`` gathered for the objective), the draft's
blocks (forward, objective and backward of the drafter) and the optimizer step.

The blocks' activations are not formulas: they are the census of the real step on the meta device at the planned
shapes (:attr:`PlanInputs.draft_step`, made by :func:`lightning_eagle.training.dspark_memory.dspark_step_census`);
what the step reads but does not allocate (the target's outputs, the weights, gradients, optimizer states) is added
here from the shapes.
"""

from __future__ import annotations

from lightning_eagle.parallel.memory import TargetShapes
from lightning_eagle.parallel.memory_plan.draft_shapes import DraftShapes
from lightning_eagle.parallel.memory_plan.inputs import DSPARK_PHASES, RESIDENT, PlanInputs, dtype_name
from lightning_eagle.parallel.memory_plan.terms import Term, gb, shard


def dspark_outputs_bytes(inputs: PlanInputs) -> int:
    """The capture's concatenated taps ``[B,T,n_taps·H_t]`` and post-norm final hidden ``[B,T,H_t]``, alive through
    the whole step."""
    N, H_t = inputs.batch_size * inputs.seq_len, inputs.target.hidden_size
    return (len(inputs.taps) + 1) * N * H_t * inputs.target_dtype.itemsize


def _head_bytes(inputs: PlanInputs, target: TargetShapes) -> int:
    return target.lm_head.nbytes(inputs.target_dtype) or target.embedding.nbytes(inputs.target_dtype)


def dspark_terms(inputs: PlanInputs, target: TargetShapes, draft: DraftShapes) -> list[Term]:
    """The DSpark-only terms: the whole embedding the block inputs read (resident), the teacher head and draft
    blocks phases."""
    census = inputs.draft_step
    if census is None:
        raise ValueError("a DSpark plan needs the census of its drafter step (PlanInputs.draft_step)")
    V, H_t, st, s = inputs.target.vocab_size, inputs.target.hidden_size, inputs.target_dtype, inputs.draft_dtype
    terms = []
    if inputs.dense_sharded or st != s:  # the module's own whole copy; else it is the target's tensor itself
        why = "gathered from the FSDP2 shards" if inputs.dense_sharded else f"cast to {dtype_name(s)}"
        terms.append(Term(RESIDENT, "target embedding, whole (block inputs)", V * H_t * s.itemsize, why))
    outputs = Term("", "target outputs (taps, final hidden)", dspark_outputs_bytes(inputs),
                   f"{len(inputs.taps)} taps + final hidden, [B,T,·] {dtype_name(st)}")  # fmt: skip
    teacher, blocks = DSPARK_PHASES[1], DSPARK_PHASES[2]
    head = _head_bytes(inputs, target)
    terms.append(Term(teacher, outputs.name, outputs.nbytes, outputs.note))
    if inputs.dense_sharded:
        terms.append(Term(teacher, "lm_head gathered + its copy", 2 * head,
                          f"the whole [V,H_t] {gb(head)} gathered, copied for the backward"))  # fmt: skip
    terms.append(Term(blocks, outputs.name, outputs.nbytes, outputs.note))
    if inputs.dense_sharded:
        terms.append(Term(blocks, "lm_head copy", head, "the objective's whole [V,H_t] through the backward"))
    settings = inputs.draft_settings
    A = min(inputs.objective.num_anchors, inputs.seq_len)
    ckpt = "recomputed per layer" if settings.activation_checkpointing else "every layer's activations kept"
    terms += [
        Term(blocks, "drafter activations kept for the backward", census.kept_after_forward,
             f"{A} anchors x g={inputs.draft.block_size} per row, {settings.block_chunk} per attention call, {ckpt}, "
             f"{inputs.loss_backend} objective; census of the real step on meta"),
        Term(blocks, "backward working set", census.peak - census.kept_after_forward,
             "the census's peak over forward + backward (attention backward: per-head key/value gradients)"),
    ]  # fmt: skip
    if inputs.accumulate_grad_batches == 1:
        terms.append(Term(blocks, "parameter gradients", shard(draft.trainable, inputs) * s.itemsize))
    if inputs.draft_shard:
        gathered = (draft.trainable - shard(draft.trainable, inputs)) * s.itemsize
        terms.append(Term(blocks, "drafter parameters gathered (FSDP2)", gathered))
    return terms
