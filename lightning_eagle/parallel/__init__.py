"""Expert parallelism for the frozen K3 target and the up-front layout gates."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lightning_eagle.parallel.layout import (
    HasTargetSpec,
    ParallelLayout,
    ReplicatedTarget,
    TargetParallelism,
    target_parallelism,
    validate_layout,
)
from lightning_eagle.parallel.validate import UnsupportedLayoutError

# Lazy: the strategy imports Lightning (seconds); the layout gates must stay cheap to import.
_EXPORTS = {
    "ExpertParallelStrategy": "lightning_eagle.parallel.strategy",
    "TorchExpertDispatcher": "lightning_eagle.parallel.dispatcher",
    "AllGatherExpertDispatcher": "lightning_eagle.parallel.dispatcher",
    "DeepEPDispatcher": "lightning_eagle.parallel.dispatcher",
    "HybridEPDispatcher": "lightning_eagle.parallel.dispatcher",
    "build_dispatcher": "lightning_eagle.parallel.dispatcher",
    "enable_expert_parallel": "lightning_eagle.parallel.shard",
    "expert_range": "lightning_eagle.parallel.shard",
    "routed_expert_bytes": "lightning_eagle.parallel.shard",
    "all_reduce_gradients": "lightning_eagle.parallel.grad_sync",
    "per_rank_memory_report": "lightning_eagle.parallel.memory",
    "memory_table": "lightning_eagle.parallel.memory",
    "launch_local": "lightning_eagle.parallel.local_launch",
    "validate_target_config": "lightning_eagle.k3.target_spec",
}

__all__ = [
    "HasTargetSpec",
    "ParallelLayout",
    "ReplicatedTarget",
    "TargetParallelism",
    "UnsupportedLayoutError",
    "target_parallelism",
    "validate_layout",
    *sorted(_EXPORTS),
]

if TYPE_CHECKING:  # pragma: no cover — what IDEs and type checkers see; a test keeps it equal to _EXPORTS
    from lightning_eagle.k3.target_spec import validate_target_config
    from lightning_eagle.parallel.dispatcher import (
        AllGatherExpertDispatcher,
        DeepEPDispatcher,
        HybridEPDispatcher,
        TorchExpertDispatcher,
        build_dispatcher,
    )
    from lightning_eagle.parallel.grad_sync import all_reduce_gradients
    from lightning_eagle.parallel.local_launch import launch_local
    from lightning_eagle.parallel.memory import memory_table, per_rank_memory_report
    from lightning_eagle.parallel.shard import enable_expert_parallel, expert_range, routed_expert_bytes
    from lightning_eagle.parallel.strategy import ExpertParallelStrategy


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
