"""One line of a plan (:class:`Term`), the phases every plan has, and the helpers every family's terms use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_eagle.parallel.memory import GB

if TYPE_CHECKING:
    from lightning_eagle.planning.inputs import PlanInputs

RESIDENT = "resident"  # held for the whole run
TARGET_FORWARD = "target forward"  # every family's first phase: the target's no-grad capture
OPTIMIZER_STEP = "optimizer step"  # every family's last phase
FP32 = 4  # bytes


@dataclass(frozen=True)
class Term:
    """One line of the plan: bytes a rank holds for ``name`` during ``phase`` (or for the whole run: resident)."""

    phase: str
    name: str
    nbytes: int
    note: str = ""


def gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``, as configs spell it."""
    return str(dtype).removeprefix("torch.")


def shard(numel: int, inputs: PlanInputs) -> int:
    """Elements of a draft tensor set one rank holds: all of them, or ``ceil(numel / world)`` with ``draft_shard``."""
    return -(-numel // inputs.world) if inputs.draft_shard else numel
