"""The DSpark family's memory plan (:func:`dspark_terms`) and its
:class:`~lightning_eagle.planning.family.PlanningFamily` record: the phases are the target's no-grad forward (shared
with every family), the teacher head (a dense-sharded target's whole ``lm_head`` gathered for the objective), the
draft's blocks (forward, objective and backward of the drafter) and the optimizer step.

The blocks' activations are not formulas: they are the census of the real step on the meta device at the planned
shapes (:attr:`PlanInputs.draft_step`, made by :func:`lightning_eagle.planning.dspark_census.dspark_step_census`);
what the step reads but does not allocate (the target's outputs, the weights, gradients, optimizer states) is added
here from the shapes.
"""

from __future__ import annotations

from lightning_eagle.draft.dspark_config import DSparkDraftConfig
from lightning_eagle.draft.dspark_export import DSPARK
from lightning_eagle.parallel.memory import TargetShapes
from lightning_eagle.planning.census import StepCensus
from lightning_eagle.planning.draft_shapes import DraftShapes, on_meta
from lightning_eagle.planning.dspark_census import dspark_step_census
from lightning_eagle.planning.family import PlanningFamily, register_planning_family
from lightning_eagle.planning.inputs import PlanInputs
from lightning_eagle.planning.terms import OPTIMIZER_STEP, RESIDENT, TARGET_FORWARD, Term, dtype_name, gb, shard
from lightning_eagle.training.dspark_data import check_block_fits
from lightning_eagle.training.dspark_settings import check_dspark_sequence_parallel

DSPARK_PHASES = (TARGET_FORWARD, "teacher head", "draft blocks", OPTIMIZER_STEP)


def dspark_outputs_bytes(inputs: PlanInputs) -> int:
    """The capture's concatenated taps ``[B,T,n_taps·H_t]`` and post-norm final hidden ``[B,T,H_t]``, alive through
    the whole step."""
    N, H_t = inputs.batch_size * inputs.seq_len, inputs.target.hidden_size
    return (len(inputs.aux_layer_ids) + 1) * N * H_t * inputs.target_dtype.itemsize


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
                   f"{len(inputs.aux_layer_ids)} taps + final hidden, [B,T,·] {dtype_name(st)}")  # fmt: skip
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


def dspark_draft_shapes(config: DSparkDraftConfig) -> DraftShapes:
    """The DSpark drafter's parameters, from the real module on meta: all trained (the embedding and ``lm_head`` are
    the target's, not the drafter's); ``projection`` is ``context_proj``. Its backward is a census, not groups."""
    from lightning_eagle.draft.dspark import DSparkDrafter

    drafter = on_meta(lambda: DSparkDrafter(config))
    sizes = {n: p.numel() for n, p in drafter.named_parameters()}
    return DraftShapes(
        trainable=sum(sizes.values()), frozen=0, buffer_bytes=0, largest_trainable=max(sizes.values()),
        projection=sizes["context_proj.weight"], groups=(),
    )  # fmt: skip


def check_dspark(inputs: PlanInputs) -> None:
    """What the plan refuses for a DSpark run: what the module refuses (draft sequence parallelism, a block no row can
    hold), a device other than CUDA (the census counts CUDA's attention kernel)."""
    check_dspark_sequence_parallel(inputs.draft_sp)
    check_block_fits(inputs.draft.block_size, inputs.seq_len)
    if inputs.device != "cuda":
        raise ValueError(f"--device {inputs.device}: the DSpark plan counts CUDA's attention kernel only")


def describe_dspark(inputs: PlanInputs) -> str:
    i, d, settings = inputs, inputs.draft, inputs.draft_settings
    ckpt = "on" if settings.activation_checkpointing else "off"
    return (
        f"micro-batch {i.batch_size} x {i.seq_len} tokens, DSpark {d.num_hidden_layers} layers, block "
        f"{d.block_size}, {i.objective.num_anchors} anchors per row, {settings.block_chunk} per attention "
        f"call, {settings.kv_cache} K/V, activation checkpointing {ckpt}, target {dtype_name(i.target_dtype)} "
        f"({i.expert_storage} experts), draft {dtype_name(i.draft_dtype)}, full vocabulary {d.vocab_size}"
    )


def dspark_census(inputs: PlanInputs) -> StepCensus:
    """The census of the drafter's step at the planned micro-batch (:func:`dspark_step_census`)."""
    return dspark_step_census(
        inputs.draft, inputs.draft_settings, inputs.objective, batch_size=inputs.batch_size, seq_len=inputs.seq_len,
        target_dtype=inputs.target_dtype,
    )  # fmt: skip


DSPARK_PLAN = register_planning_family(PlanningFamily(
    name=DSPARK, phases=DSPARK_PHASES, draft_shapes=dspark_draft_shapes, check=check_dspark, step_terms=dspark_terms,
    describe=describe_dspark, census=dspark_census,
))  # fmt: skip
