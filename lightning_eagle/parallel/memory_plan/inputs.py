"""What the memory plan is computed from: :class:`PlanInputs` — a run's target config and draft config, the same
typed settings the module runs with (:mod:`lightning_eagle.run_settings`), the strategy's :class:`ParallelLayout`,
the micro-batch, and the stated assumptions — and the names of the plan's phases.

The settings are the module's, defaults included, and were checked when they were made; ``auto`` backends are
resolved here by the same registries ``fit`` resolves them with, for the planned device (:attr:`PlanInputs.device`;
on CUDA the TTT attention's ``auto`` is ``flex_attention`` where Triton is there, :attr:`PlanInputs.flex_available`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_eagle.backends import LOSS_BACKEND, TTT_ATTENTION_BACKEND
from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.draft.dspark_config import DSparkDraftConfig
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.parallel.layout import ParallelLayout
from lightning_eagle.parallel.memory import GB, check_ep_size
from lightning_eagle.parallel.memory_plan.census import StepCensus
from lightning_eagle.run_settings import (
    DraftSettings,
    ObjectiveSettings,
    TargetSettings,
    check_draft_sequence_parallel,
    check_dspark_sequence_parallel,
)

if TYPE_CHECKING:
    from lightning_eagle.k3.target_spec import TargetSpec

RESIDENT = "resident"
PHASES = ("target forward", "teacher", "draft unroll", "optimizer step")
DSPARK_PHASES = ("target forward", "teacher head", "draft blocks", "optimizer step")
FP32 = 4  # bytes


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``, as configs spell it."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan reads from a run config (``lightning-eagle memory-plan`` reads one), plus the stated
    assumptions. The properties below are the plan's view of the settings: sizes and ``auto`` resolved.

    A DSpark run (``draft`` a :class:`DSparkDraftConfig`, the settings groups DSpark's) carries the census of its
    drafter step in ``draft_step`` (:func:`lightning_eagle.training.dspark_memory.dspark_step_census`)."""

    target: KimiK3TextConfig
    draft: (
        Eagle3DraftConfig | DSparkDraftConfig
    )  # built with the run's overrides; EAGLE-3's ``draft_vocab_size`` is N_d
    layout: ParallelLayout = ParallelLayout(world_size=1)
    target_settings: TargetSettings = TargetSettings()
    draft_settings: DraftSettings = DraftSettings()
    objective: ObjectiveSettings = ObjectiveSettings()
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
        if self.family == "dspark":
            self._check_dspark()
        else:
            check_draft_sequence_parallel(
                self.draft_sp, num_attention_heads=self.draft.num_attention_heads, draft=self.draft_settings,
                target_source=self.target_settings.source,
            )  # fmt: skip
        if self.target_settings.source != "online":
            raise ValueError(
                f"model.target.source={self.target_settings.source!r} is not modelled by the memory plan (only "
                "'online': a run from dumped features holds no target)"
            )
        if self.family == "dspark":
            return
        unmodelled = {"architecture": "k3", "fc_norm": False, "norm_output": False}
        for name, value in unmodelled.items():
            if getattr(self.draft, name) != value:
                raise ValueError(
                    f"model.draft.config.{name}={getattr(self.draft, name)!r} is not modelled by the memory plan"
                )

    def _check_dspark(self) -> None:
        check_dspark_sequence_parallel(self.draft_sp)
        if self.device != "cuda":
            raise ValueError(f"--device {self.device}: the DSpark plan counts CUDA's attention kernel only")

    @property
    def family(self) -> str:
        """``"dspark"`` or ``"eagle3"``: which draft family the run trains."""
        return "dspark" if isinstance(self.draft, DSparkDraftConfig) else "eagle3"

    @property
    def phases(self) -> tuple[str, ...]:
        return DSPARK_PHASES if self.family == "dspark" else PHASES

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
    def activation_checkpointing(self) -> bool:
        return self.draft_settings.activation_checkpointing

    @property
    def ttt_kv_cache(self) -> str:
        return self.draft_settings.ttt_kv_cache

    @property
    def attention_backend(self) -> str:
        """The TTT attention that runs on the planned device (``auto`` resolved as ``fit`` resolves it there)."""
        return TTT_ATTENTION_BACKEND.resolve(
            self.draft_settings.attention_backend, self.device, flex_available=self.flex_available
        )

    @property
    def ttt_steps(self) -> int:
        return self.objective.ttt_steps

    @property
    def loss_backend(self) -> str:
        """The TTT loss that runs on the planned device (``auto`` resolved)."""
        return LOSS_BACKEND.resolve(self.objective.loss_backend, self.device)

    @property
    def loss_chunk(self) -> int:
        return self.objective.loss_chunk

    @property
    def teacher_vocab_chunk(self) -> int:
        return self.objective.teacher_vocab_chunk

    @property
    def teacher_seq_chunk(self) -> int:
        return self.objective.teacher_seq_chunk

    @property
    def local_seq_len(self) -> int:
        """Slots one rank of a draft sequence-parallel group owns (T padded up to a multiple of the group)."""
        return -(-self.seq_len // self.draft_sp)

    @property
    def taps(self) -> tuple[int, ...]:
        ids = self.target_settings.aux_layer_ids
        if ids is None:
            ids = self.draft.target_layer_ids if self.family == "dspark" else self.draft.aux_layer_ids
        return tuple(ids or ())

    @classmethod
    def for_target(cls, spec: TargetSpec, draft: Eagle3DraftConfig | DSparkDraftConfig, target_settings: TargetSettings,
                   **settings) -> PlanInputs:  # fmt: skip
        """The inputs of a run on ``spec``'s target (its config and resolved taps, already validated); ``settings``
        are the other fields (layout, settings groups, micro-batch, assumptions)."""
        resolved = dataclasses.replace(target_settings, aux_layer_ids=tuple(spec.aux_layer_ids))
        return cls(target=spec.config, draft=draft, target_settings=resolved, **settings)
