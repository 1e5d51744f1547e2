"""The plan as the command prints it: a header naming the run and the assumptions, the table of every term
(decimal GB) with each phase's total and the peak, and the verdict line (``fits: …`` / ``does not fit: …``)."""

from __future__ import annotations

from lightning_eagle.parallel.memory import GB
from lightning_eagle.planning.family import planning_family
from lightning_eagle.planning.fit import Fit
from lightning_eagle.planning.inputs import PlanInputs
from lightning_eagle.planning.plan import MemoryPlan
from lightning_eagle.planning.terms import RESIDENT


def plan_header(inputs: PlanInputs, nodes: int, gpus_per_node: int, target_label: str) -> str:
    """What is planned: the target, the layout, the micro-batch and draft settings, and the stated assumptions."""
    i = inputs
    cluster = f"{nodes} node(s) x {gpus_per_node} GPU(s)"
    world = f"world {i.world} ({cluster})" if i.world == nodes * gpus_per_node else f"world {i.world}"
    dense = f"dense weights FSDP2-sharded over {i.world}" if i.dense_sharded else "dense weights replicated"
    draft = "sharded" if i.draft_shard else "replicated"
    return "\n".join([
        f"target: {target_label}",
        f"{world}, expert_parallel_size {i.ep} ({i.target.num_experts // i.ep} experts/layer), {dense}, draft {draft}",
        planning_family(i.family).describe(i),
        f"assumptions: {i.device} kernels, MoE load factor {i.moe_load_factor}, "
        f"runtime reserve {i.reserve_bytes / GB:.1f} GB",
    ])  # fmt: skip


def format_plan(plan: MemoryPlan) -> str:
    """The table of every term (decimal GB), each phase's total, and the peak."""
    rows = [("phase", "term", "GB", "note")]
    for phase in (RESIDENT, *plan.inputs.phases):
        for t in plan.terms:
            if t.phase == phase:
                rows.append((phase, t.name, f"{t.nbytes / GB:.3f}", t.note))
        total = plan.phase_bytes(phase)
        label = "resident total" if phase == RESIDENT else f"{phase} total (on top of resident)"
        rows.append(("", label, f"{total / GB:.3f}", "peak phase" if phase == plan.peak_phase else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"peak per GPU: {plan.peak_bytes / GB:.2f} GB = resident {plan.resident_bytes / GB:.2f} GB + "
                 f"{plan.peak_phase} {plan.phase_bytes(plan.peak_phase) / GB:.2f} GB")  # fmt: skip
    return "\n".join(lines)


def verdict(plan: MemoryPlan, gpu_bytes: int, fit: Fit | None, gpus_per_node: int, searched_nodes: int) -> str:
    """The last line: ``fits: …`` or ``does not fit: …`` with the margin or overflow and the smallest fit."""
    peak, cap = plan.peak_bytes / GB, gpu_bytes / GB
    if plan.peak_bytes <= gpu_bytes:
        return f"fits: peak {peak:.1f} GB of {cap:.0f} GB per GPU (margin {cap - peak:.1f} GB)"
    line = f"does not fit: peak {peak:.1f} GB of {cap:.0f} GB per GPU (over by {peak - cap:.1f} GB)"
    if fit is None:
        return line + f"; no layout up to {searched_nodes} nodes x {gpus_per_node} GPUs fits"
    return (
        line + f"; smallest fit: {fit.nodes} nodes x {gpus_per_node} GPUs (world {fit.nodes * gpus_per_node}) with "
        f"expert_parallel_size {fit.ep} (peak {fit.plan.peak_bytes / GB:.1f} GB)"
    )
