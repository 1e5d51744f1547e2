"""The one loading path of the frozen K3 for a LightningModule's run (training and feature dumps): this rank's expert
slice on its device, placed by the run's strategy through :class:`~lightning_eagle.parallel.layout.TargetParallelism`.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_eagle.k3.model import KimiK3ForCausalLM
from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.parallel.layout import TargetParallelism, target_parallelism


def parallelism_of(owner: pl.LightningModule) -> TargetParallelism:
    """How ``owner``'s strategy places the target (replicated outside a trainer)."""
    trainer = owner._trainer
    return target_parallelism(trainer.strategy if trainer is not None else None)


def root_device(owner: pl.LightningModule) -> torch.device:
    """The device ``owner``'s strategy places it on (the CPU outside a trainer)."""
    return owner._trainer.strategy.root_device if owner._trainer is not None else torch.device("cpu")


def load_frozen_target(owner: pl.LightningModule, spec: TargetSpec) -> KimiK3ForCausalLM:
    """The frozen K3 ``spec`` names, as ``owner``'s rank holds it (e.g. with the expert-parallel dispatcher)."""
    spec.require_k3("the frozen target's forward (model.target.source: online)")
    parallelism = parallelism_of(owner)
    expert_range = parallelism.expert_range(spec.num_experts)  # refuses an unsplittable expert count before any read
    target = KimiK3ForCausalLM.from_pretrained(
        spec.path, dtype=spec.torch_dtype, device=root_device(owner), expert_range=expert_range,
        expert_storage=spec.expert_storage, shard=parallelism.dense_sharding(),
    )  # fmt: skip
    return parallelism.parallelize_target(target)
