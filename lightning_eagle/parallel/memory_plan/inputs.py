"""What the memory plan is computed from: :class:`PlanInputs` (a run's target, draft, layout, micro-batch and the
stated assumptions), checked when built, and the names of the plan's phases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.target_spec import EXPERT_STORAGES
from lightning_eagle.parallel.memory import GB, check_ep_size
from lightning_eagle.settings import DEFAULT_LOSS_CHUNK, DEFAULT_TTT_STEPS

if TYPE_CHECKING:
    from lightning_eagle.k3.target_spec import TargetSpec

RESIDENT = "resident"
PHASES = ("target forward", "teacher", "draft unroll", "optimizer step")
MODELLED_BACKENDS = ("eager", "flash_lse")
LOSS_BACKENDS = ("plain", "chunked")
TTT_KV_CACHES = ("expanded", "latent")
FP32 = 4  # bytes


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``, as configs spell it."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan reads from a run config (``python -m lightning_eagle.commands.memory_plan`` reads one), plus
    the stated assumptions."""

    target: KimiK3TextConfig
    draft: Eagle3DraftConfig  # built with the run's overrides; ``draft_vocab_size`` is N_d
    world: int = 1
    ep: int = 1
    shard_dense: bool | None = None  # None: on when world > 1 (the strategy's default)
    draft_shard: bool = False
    target_dtype: torch.dtype = torch.bfloat16
    expert_storage: str = "mxfp4"
    draft_dtype: torch.dtype = torch.bfloat16
    batch_size: int = 1
    seq_len: int = 4096
    ttt_steps: int = DEFAULT_TTT_STEPS
    attention_backend: str = "flash_lse"
    activation_checkpointing: bool = False
    accumulate_grad_batches: int = 1
    teacher_vocab_chunk: int = 16384
    teacher_seq_chunk: int = 2048
    loss_backend: str = "plain"  # "chunked": fused lm_head + soft CE with the teacher computed per chunk
    loss_chunk: int = DEFAULT_LOSS_CHUNK  # rows per chunk of the chunked loss
    ttt_kv_cache: str = "expanded"  # "latent": the TTT cache keeps MLA's normalised latent + rope key
    target_token_chunk: int | None = None  # the target forward in token segments of this many tokens
    draft_sp: int = 1  # draft sequence-parallel size: the ranks of one group share a sequence, each owns T/sp slots
    aux_layer_ids: tuple[int, ...] | None = None  # None: the draft config's
    device: str = "cuda"
    moe_load_factor: float = 1.25
    reserve_bytes: int = int(4 * GB)

    def __post_init__(self) -> None:
        check_ep_size(self.target, self.ep)
        if self.world < 1 or self.world % self.ep:
            raise ValueError(f"expert_parallel_size ({self.ep}) must divide the world size ({self.world})")
        if self.attention_backend not in MODELLED_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is not modelled by the memory plan; "
                f"choose one of {MODELLED_BACKENDS}"
            )
        unmodelled = {"architecture": "k3", "fc_norm": False, "norm_output": False}
        for name, value in unmodelled.items():
            if getattr(self.draft, name) != value:
                raise ValueError(f"draft {name}={getattr(self.draft, name)!r} is not modelled by the memory plan")
        for name, value, choices in (
            ("loss_backend", self.loss_backend, LOSS_BACKENDS), ("ttt_kv_cache", self.ttt_kv_cache, TTT_KV_CACHES),
        ):  # fmt: skip
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not modelled by the memory plan; choose one of {choices}")
        for name, value in (("loss_chunk", self.loss_chunk), ("target_token_chunk", self.target_token_chunk or 1)):
            if value < 1:
                raise ValueError(f"{name} must be a positive number of tokens, got {value!r}")
        if self.draft_sp < 1 or self.world % self.draft_sp:
            raise ValueError(
                f"draft_sequence_parallel_size ({self.draft_sp}) must divide the world size ({self.world})"
            )
        if self.draft.num_attention_heads % self.draft_sp:
            raise ValueError(
                f"draft_sequence_parallel_size ({self.draft_sp}) must divide the draft's "
                f"{self.draft.num_attention_heads} attention heads (Ulysses shards the heads)"
            )
        if self.ttt_kv_cache == "latent" and self.draft_sp > 1:
            raise ValueError(
                f"ttt_kv_cache='latent' with draft_sequence_parallel_size={self.draft_sp}: the latent cache has one "
                "head, which Ulysses cannot shard (the draft refuses it too); use ttt_kv_cache='expanded'"
            )
        if self.expert_storage not in EXPERT_STORAGES:
            raise ValueError(f"target_expert_storage must be one of {EXPERT_STORAGES}, got {self.expert_storage!r}")

    @property
    def dense_sharded(self) -> bool:
        return self.shard_dense if self.shard_dense is not None else self.world > 1

    @property
    def local_seq_len(self) -> int:
        """Slots one rank of a draft sequence-parallel group owns (T padded up to a multiple of the group)."""
        return -(-self.seq_len // self.draft_sp)

    @property
    def taps(self) -> tuple[int, ...]:
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else self.draft.aux_layer_ids
        return tuple(ids or ())

    @classmethod
    def for_target(cls, spec: TargetSpec, draft: Eagle3DraftConfig, **settings) -> PlanInputs:
        """The inputs of a run on ``spec``'s target (its config, dtype, expert storage and taps, already validated);
        ``settings`` are the other fields (layout, micro-batch, draft training settings, assumptions)."""
        return cls(
            target=spec.config, draft=draft, target_dtype=spec.torch_dtype, expert_storage=spec.expert_storage,
            aux_layer_ids=tuple(spec.aux_layer_ids), **settings,
        )  # fmt: skip
