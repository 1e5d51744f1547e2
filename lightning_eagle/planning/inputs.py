"""What the memory plan is computed from: :class:`PlanInputs` — a run's target config and draft config, the name of
its draft family, the same typed settings the family's module runs with (:mod:`lightning_eagle.run_settings`), the
strategy's :class:`ParallelLayout`, the micro-batch, and the stated assumptions.

The settings are the module's, defaults included, and were checked when they were made; ``auto`` backends are
resolved by the same registries ``fit`` resolves them with, for the planned device (:attr:`PlanInputs.device`; on
CUDA the TTT attention's ``auto`` is ``flex_attention`` where Triton is there, :attr:`PlanInputs.flex_available`).
What the plan does not model for a family is refused by the family's record
(:attr:`~lightning_eagle.planning.family.PlanningFamily.check`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_eagle.backends import LOSS_BACKEND
from lightning_eagle.draft.family import draft_family_named
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.parallel.layout import ParallelLayout
from lightning_eagle.parallel.memory import GB, check_ep_size
from lightning_eagle.planning.census import StepCensus
from lightning_eagle.planning.family import planning_family
from lightning_eagle.run_settings import TargetSettings

if TYPE_CHECKING:
    from lightning_eagle.k3.target_spec import TargetSpec


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan reads from a run config (``lightning-eagle memory-plan`` reads one), plus the stated
    assumptions. The properties below are the plan's view of the settings: sizes and ``auto`` resolved.

    ``family`` names the draft family (its :class:`~lightning_eagle.planning.family.PlanningFamily` plans it);
    ``draft`` is its draft config and ``draft_settings`` / ``objective`` are its own settings groups (the types of
    its module's ``settings_groups``), as its module's ``run_spec`` and ``__init__`` make them. A family whose draft
    step is a census carries it in ``draft_step``."""

    target: KimiK3TextConfig
    draft: Any  # the family's draft config, built with the run's overrides
    family: str
    target_settings: TargetSettings
    draft_settings: Any
    objective: Any
    layout: ParallelLayout = ParallelLayout(world_size=1)
    batch_size: int = 1
    seq_len: int = 4096
    accumulate_grad_batches: int = 1
    device: str = "cuda"
    flex_available: bool = True  # the planned GPUs have Triton (torch's CUDA wheels ship it): auto → flex_attention
    moe_load_factor: float = 1.25
    reserve_bytes: int = int(4 * GB)
    draft_step: StepCensus | None = None

    def __post_init__(self) -> None:
        if self.layout.world_size is None:
            raise ValueError("the plan needs the world size: ParallelLayout(world_size=...)")
        check_ep_size(self.target, self.ep)
        for name, value in (("batch_size", self.batch_size), ("seq_len", self.seq_len),
                            ("accumulate_grad_batches", self.accumulate_grad_batches)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.target_settings.source != "online":
            raise ValueError(
                f"model.target.source={self.target_settings.source!r} is not modelled by the memory plan (only "
                "'online': a run from dumped features holds no target)"
            )
        planning_family(self.family).check(self)

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases of one step after the resident weights (the family's)."""
        return planning_family(self.family).phases

    def with_world(self, world: int, ep: int) -> PlanInputs:
        """The same run on ``world`` ranks at expert-parallel size ``ep``."""
        layout = dataclasses.replace(self.layout, world_size=world, expert_parallel_size=ep)
        return dataclasses.replace(self, layout=layout)

    # ---- the plan's view of the settings -------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.layout.world_size

    @property
    def ep(self) -> int:
        return self.layout.expert_parallel_size

    @property
    def draft_sp(self) -> int:
        """Draft sequence-parallel size: the ranks of one group share a sequence, each owns T/sp slots."""
        return self.layout.draft_sequence_parallel_size

    @property
    def dense_sharded(self) -> bool:
        return self.layout.dense_sharded

    @property
    def target_dtype(self) -> torch.dtype:
        return DTYPES[self.target_settings.dtype]

    @property
    def expert_storage(self) -> str:
        return self.target_settings.expert_storage

    @property
    def target_token_chunk(self) -> int | None:
        return self.target_settings.token_chunk

    @property
    def draft_dtype(self) -> torch.dtype:
        return DTYPES[self.draft_settings.dtype]

    @property
    def draft_shard(self) -> bool:
        return self.draft_settings.shard

    @property
    def master_weights(self) -> bool:
        """fp32 masters of a 16-bit draft (``model.draft.master_weights``)."""
        return self.draft_settings.master_copy

    @property
    def masters_partitioned(self) -> bool:
        """A replicated draft's fp32 masters and their AdamW states split over several ranks (ZeRO-1)."""
        return self.master_weights and not self.draft_shard and self.world > 1

    @property
    def stored_bytes(self) -> int:
        """Bytes per trained parameter as stored (and its gradient, and each AdamW state when :attr:`state_bytes` is
        the same): fp32 shards of a sharded draft with masters, else the draft's dtype."""
        return 4 if self.master_weights and self.draft_shard else self.draft_dtype.itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes per element of each AdamW state: fp32 with masters, else the parameter dtype."""
        return 4 if self.master_weights else self.draft_dtype.itemsize

    @property
    def activation_checkpointing(self) -> bool:
        return self.draft_settings.activation_checkpointing

    @property
    def loss_backend(self) -> str:
        """The draft's loss that runs on the planned device (``auto`` resolved)."""
        return LOSS_BACKEND.resolve(self.objective.loss_backend, self.device)

    @property
    def loss_chunk(self) -> int:
        return self.objective.loss_chunk

    @property
    def local_seq_len(self) -> int:
        """Slots one rank of a draft sequence-parallel group owns (T padded up to a multiple of the group)."""
        return -(-self.seq_len // self.draft_sp)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers the draft reads: ``model.target.aux_layer_ids``, else the draft config's own."""
        ids = self.target_settings.aux_layer_ids
        if ids is None:
            ids = draft_family_named(self.family).aux_layer_ids(self.draft)
        return tuple(ids or ())

    @classmethod
    def for_target(cls, spec: TargetSpec, draft: Any, target_settings: TargetSettings, **settings) -> PlanInputs:
        """The inputs of a run on ``spec``'s target (its config and resolved taps, already validated); ``settings``
        are the other fields (family, its settings groups, layout, micro-batch, assumptions)."""
        resolved = dataclasses.replace(target_settings, aux_layer_ids=tuple(spec.aux_layer_ids))
        return cls(target=spec.config, draft=draft, target_settings=resolved, **settings)
