"""The parallel layout of one run, and what a training module may ask of the strategy that owns it.

``ParallelLayout`` is the one object that says how the frozen target and the draft are placed over ranks. Every
instance is valid: the constructor runs :func:`~lightning_eagle.parallel.validate.validate_layout`, and facts that are
not known yet (the world size before ``Trainer(...)``, the expert count before the module names its target) are
``None`` — never a placeholder. A strategy *refines* its layout as facts arrive (:meth:`ParallelLayout.refine`), so a
refused setting fails at the first moment it can be judged and always before any target weight is read.

``TargetParallelism`` is the contract between ``Eagle3Module`` / ``FeatureDumper`` and the strategy:
``ExpertParallelStrategy`` implements it; any other strategy gets :class:`ReplicatedTarget` (every rank loads the
whole target) through :func:`target_parallelism`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import nn

from lightning_eagle.parallel.validate import validate_layout


@dataclass(frozen=True)
class ParallelLayout:
    """World, expert-parallel mesh and the refused dimensions (accepted only at their supported values).

    ``data_parallel_size = world_size / expert_parallel_size``: every rank is data-parallel for the draft; the ranks
    of one expert-parallel group share the target's routed experts.
    """

    expert_parallel_size: int = 1
    target_dispatcher: str = "torch"
    target_shard_dense: bool | None = None  # None: on when the world has more than one rank
    world_size: int | None = None
    num_experts: int | None = None
    device_types: tuple[str, ...] | None = None
    # Refused dimensions: they exist so that a config asking for them fails with the setting's name.
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_packing: bool = False
    target_backend: str = "colocated"
    p_eagle: bool = False
    target_force_hf: bool = False

    def __post_init__(self) -> None:
        if self.device_types is not None and not isinstance(self.device_types, tuple):
            object.__setattr__(self, "device_types", tuple(self.device_types))
        validate_layout(**{k: v for k, v in dataclasses.asdict(self).items() if k != "target_shard_dense"})

    @property
    def data_parallel_size(self) -> int | None:
        return None if self.world_size is None else self.world_size // self.expert_parallel_size

    @property
    def dense_sharded(self) -> bool:
        """Whether the target's dense (non-routed) weights are split over all ranks (FSDP2, gathered per layer)."""
        if self.target_shard_dense is not None:
            return self.target_shard_dense
        return (self.world_size or 1) > 1

    def refine(self, **facts: Any) -> ParallelLayout:
        """This layout with newly known facts (``world_size``, ``num_experts``, ``device_types``), validated."""
        unknown = set(facts) - {"world_size", "num_experts", "device_types"}
        if unknown:
            raise TypeError(f"refine() takes facts learnt at run time, not settings: {sorted(unknown)}")
        return dataclasses.replace(self, **facts)


SINGLE_PROCESS = ParallelLayout(world_size=1)


@runtime_checkable
class TargetParallelism(Protocol):
    """How a strategy places the frozen target; what ``load_frozen_target`` asks of ``trainer.strategy``."""

    @property
    def layout(self) -> ParallelLayout: ...

    def expert_range(self, num_experts: int) -> tuple[int, int] | None:
        """``(start, count)`` of the routed experts this rank loads; None = all of them."""
        ...

    def dense_sharding(self) -> Callable[[nn.Module], object] | None:
        """Applied by the loader to the meta-device target before any weight is read (e.g. FSDP2 over all ranks);
        None = the dense weights are replicated."""
        ...

    def parallelize_target(self, target: nn.Module) -> nn.Module:
        """Called once after loading: install whatever the layout needs (e.g. the expert-parallel dispatcher)."""
        ...


class ReplicatedTarget:
    """Every rank holds the whole target: single-device and plain data-parallel (DDP) strategies."""

    def __init__(self, world_size: int = 1) -> None:
        self.layout = dataclasses.replace(SINGLE_PROCESS, world_size=world_size, target_shard_dense=False)

    def expert_range(self, num_experts: int) -> None:
        return None

    def dense_sharding(self) -> None:
        return None

    def parallelize_target(self, target: nn.Module) -> nn.Module:
        return target


def target_parallelism(strategy: Any | None) -> TargetParallelism:
    """The strategy itself if it implements :class:`TargetParallelism`, else a replicated target."""
    if isinstance(strategy, TargetParallelism):
        return strategy
    return ReplicatedTarget(getattr(strategy, "world_size", 1) or 1)
