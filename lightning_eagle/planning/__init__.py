"""Per-rank **peak** memory of a draft-training run, planned from typed inputs (:class:`PlanInputs`): will it fit the
GPUs? The layer above training: it reads a run config as the family's module reads it (:mod:`.run_config`) and
measures a family's real step where the family's record says so.

``python -m lightning_eagle.commands.memory_plan --config kimi_k3_eagle3 --gpu-gb 80 --target-config k3`` reads a
run config into :class:`PlanInputs` and prints every term below (decimal GB) and, last, ``fits: …`` or
``does not fit: …`` with the smallest cluster that fits.

Every draft family is planned through its :class:`~lightning_eagle.planning.family.PlanningFamily` record,
registered next to its planning code (EAGLE-3: :mod:`.eagle3_plan`; DSpark: :mod:`.dspark_plan`): its phases, its
draft's parameters, its own terms, its header line, what the plan does not model for it, and — the method to grow,
the more trustworthy one — the census of its real step on the meta device (:mod:`.census`; DSpark's:
:mod:`.dspark_census`). The shared code never names a family.

An EAGLE-3 training step goes through four phases, each with its own transient memory on top of what every rank
holds for the whole run (``resident``). The plan is ``resident + max over phases`` (a DSpark step's phases are the
target forward, the teacher head, the draft blocks and the optimizer step, :mod:`.dspark_plan`):

==================  ======================================================================================
resident            target dense weights (replicated, or this rank's FSDP2 shard), routed experts of this EP
                    rank (MXFP4-packed or dequantised), draft parameters, AdamW states (2 per trainable
                    parameter, in the parameter dtype: torch AdamW keeps ``exp_avg``/``exp_avg_sq`` like the
                    parameter and this library keeps no fp32 master copy, so a bf16 draft has bf16 states;
                    a float32 draft has float32 ones), gradients kept between micro-batches (gradient
                    accumulation), a runtime reserve.
target forward      no-grad capture: FSDP2 gathers (the running unit + the prefetched next one), the residual
                    stream, AttnRes bank and aux taps, and the largest per-layer working set (AttnRes mix, KDA
                    chunk form, MLA through SDPA, dense SiTU MLP, or the MoE layer: expert-parallel dispatch
                    buffers, the (token, slot) pairs of the grouped expert forward, one layer's local experts
                    decoded from MXFP4, the fp32 combine).
teacher             the full ``lm_head`` gathered for the chunked teacher, one logit tile, the ``[B,T,N_d]``
                    fp32 teacher.
draft unroll        the K-step TTT forward and backward: what autograd saves per step (or, with activation
                    checkpointing, each step's input plus one step recomputed in the backward), the K/V cache,
                    the per-step fp32 log-probabilities the loss keeps, and the backward's working set
                    (gradient buffers, attention backward).
optimizer step      gradients + the optimizer's temporaries.
==================  ======================================================================================

Where the numbers come from. Parameter counts come from the real modules built on the meta device (target: one
decoder layer per kind, :mod:`lightning_eagle.parallel.memory`; draft: the whole draft, e.g.
:class:`~lightning_eagle.draft.KimiK3Eagle3Draft`). EAGLE-3's activation terms are derived from the code of the
forward and backward (each function names the tensors it counts and why they are alive): an op saves the inputs its
backward needs; ``x.float()`` of an fp32 tensor is the tensor itself; a view keeps its base storage alive.
``tests/planning/test_planning_memory_plan.py`` checks them two ways: against a census of the real draft unroll on
the meta device (every storage alive after each op, exactly: "kept after the forward" equal, the unroll peak within
3 %, at the real K3 widths too), and against the peak RSS measured on CPU for a tiny and a medium K3 (within 15 %;
the medium run is within 2 % on every phase).

Stated assumptions (none can be derived from a config): a micro-batch is ``batch_size`` rows of exactly
``max_length`` tokens (the worst case of right-padded batches); routing is uniform, with the hottest
expert-parallel rank receiving ``moe_load_factor`` times the expected rows; FSDP2 keeps at most two units gathered;
the CUDA runtime (context, NCCL buffers, allocator fragmentation) takes a fixed ``reserve``. ``device="cpu"`` plans
the CPU kernels instead (fused CPU flash attention, single-tensor AdamW), for the measured validation.

The files, one idea each: :mod:`.inputs` (what the plan reads), :mod:`.family` (the planning record of a family),
:mod:`.terms` (a plan's line, the phases every plan has), :mod:`.draft_shapes` (the draft's parameters),
:mod:`.target_forward` (the no-grad capture), :mod:`.plan` (the shared terms and the sum), :mod:`.fit` (the smallest
cluster that fits), :mod:`.report` (the printout), :mod:`.run_config` (a parsed run config read into the inputs),
:mod:`.census` (a step's live bytes on the meta device), :mod:`.cpu_probe` (a CPU phase's peak RSS); EAGLE-3's
:mod:`.eagle3_plan`, :mod:`.eagle3_shapes`, :mod:`.eagle3_unroll_forward` / :mod:`.eagle3_unroll_backward` (the TTT
unroll); DSpark's :mod:`.dspark_plan`, :mod:`.dspark_census`.
"""

from lightning_eagle.planning.draft_shapes import DraftShapes
from lightning_eagle.planning.family import PlanningFamily, planning_family, register_planning_family
from lightning_eagle.planning.fit import Fit, legal_ep_sizes, smallest_fit
from lightning_eagle.planning.inputs import PlanInputs
from lightning_eagle.planning.plan import MemoryPlan, build_plan
from lightning_eagle.planning.report import format_plan, plan_header, verdict
from lightning_eagle.planning.run_config import PlanConfigError, RunConfig, run_config
from lightning_eagle.planning.terms import OPTIMIZER_STEP, RESIDENT, TARGET_FORWARD, Term

__all__ = [
    "OPTIMIZER_STEP",
    "RESIDENT",
    "TARGET_FORWARD",
    "DraftShapes",
    "Fit",
    "MemoryPlan",
    "PlanConfigError",
    "PlanInputs",
    "PlanningFamily",
    "RunConfig",
    "Term",
    "build_plan",
    "format_plan",
    "legal_ep_sizes",
    "plan_header",
    "planning_family",
    "register_planning_family",
    "run_config",
    "smallest_fit",
    "verdict",
]
