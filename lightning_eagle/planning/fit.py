"""Does it fit, and if not, what does: the smallest cluster (and expert-parallel size) on which a run's plan fits."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_eagle.parallel.memory import target_shapes
from lightning_eagle.planning.family import planning_family
from lightning_eagle.planning.inputs import PlanInputs
from lightning_eagle.planning.plan import MemoryPlan, build_plan, resident_terms


def legal_ep_sizes(num_experts: int, world: int) -> list[int]:
    """Expert-parallel sizes that divide both the expert count and the world (``k3_target.md`` §5.1)."""
    return [ep for ep in range(1, min(num_experts, world) + 1) if num_experts % ep == 0 and world % ep == 0]


@dataclass(frozen=True)
class Fit:
    """The smallest layout that fits: ``nodes`` nodes at expert-parallel size ``ep``, and its plan."""

    nodes: int
    ep: int
    plan: MemoryPlan


def smallest_fit(inputs: PlanInputs, gpu_bytes: int, gpus_per_node: int, max_nodes: int = 256) -> Fit | None:
    """The fewest nodes (of ``gpus_per_node`` GPUs) on which some legal EP size fits, with the smallest such EP."""
    target, draft = target_shapes(inputs.target), planning_family(inputs.family).draft_shapes(inputs.draft)
    for nodes in range(1, max_nodes + 1):
        world = nodes * gpus_per_node
        for ep in legal_ep_sizes(inputs.target.num_experts, world):
            layout = inputs.with_world(world, ep)
            if sum(t.nbytes for t in resident_terms(layout, target, draft)) > gpu_bytes:
                continue  # the weights alone do not fit: no need to plan the phases
            plan = build_plan(layout, target, draft)
            if plan.peak_bytes <= gpu_bytes:
                return Fit(nodes, ep, plan)
    return None
