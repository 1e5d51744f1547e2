"""One line of a plan (:class:`Term`) and the two helpers every family's terms use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_eagle.parallel.memory import GB

if TYPE_CHECKING:
    from lightning_eagle.parallel.memory_plan.inputs import PlanInputs


@dataclass(frozen=True)
class Term:
    """One line of the plan: bytes a rank holds for ``name`` during ``phase`` (or for the whole run: resident)."""

    phase: str
    name: str
    nbytes: int
    note: str = ""


def gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


def shard(numel: int, inputs: PlanInputs) -> int:
    """Elements of a draft tensor set one rank holds: all of them, or ``ceil(numel / world)`` with ``draft_shard``."""
    return -(-numel // inputs.world) if inputs.draft_shard else numel
