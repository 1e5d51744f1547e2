"""Expert parallelism for the frozen K3 target and the up-front layout gates."""

from __future__ import annotations

import importlib

from lightning_eagle.parallel.validate import UnsupportedLayoutError, validate_layout, validate_target_config

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
}

__all__ = ["UnsupportedLayoutError", "validate_layout", "validate_target_config", *sorted(_EXPORTS)]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
