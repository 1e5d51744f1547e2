"""Weights of the frozen K3 target per rank, counted from the real module tree.

Parameter shapes come from the real module tree (one decoder layer of each kind built on the meta device, with
``nn.init`` skipped), not from a second hand-written formula, so the counts cannot drift from the model. Bytes:

* non-routed ("dense") weights: model dtype, except the fp32 islands (``A_log``, ``dt_bias``, router bias, conv weights,
  ``o_norm``; :func:`~lightning_eagle.k3.fp32_parameters.is_fp32_parameter`). Replicated on every rank, or split over
  the whole world by FSDP2 (:mod:`lightning_eagle.parallel.dense_shard`): every parameter of a unit (decoder layer,
  embedding, ``lm_head``) is chunked along dim 0 like ``torch.chunk``, ``ceil(rows / world)`` rows per rank (the first
  shard's padded size, which FSDP2 allocates on every rank); the root weights (final norm, AttnRes output mixer) stay
  replicated;
* routed experts per rank: ``E/ep`` experts × layers, either packed MXFP4 (0.5 B + 1 scale byte per 32 weights)
  or dequantised to the model dtype — what :class:`~lightning_eagle.k3.experts.RoutedExperts` holds.

For the published K3 at EP 8 / 32 / 64 this reproduces ``k3_target.md`` §5.3: ≈ 113 GB non-routed (bf16) and
181 / 45 / 22.6 GB packed, 681 / 170 / 85 GB bf16 routed experts per rank.

The whole per-rank **peak** (activations, draft, optimizer, transients) is planned in
:mod:`lightning_eagle.planning`; ``python -m lightning_eagle.commands.memory_plan --config run.yaml
--gpu-gb 80`` (or ``lightning-eagle memory-plan``) prints that plan for a LightningCLI config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.overrides import TorchFunctionMode

from lightning_eagle.k3.config import MXFP4_GROUP, KimiK3TextConfig
from lightning_eagle.k3.fp32_parameters import is_fp32_parameter
from lightning_eagle.k3.layer import K3DecoderLayer

GB = 1e9  # decimal, as in the spec's tables
ROUTED_PREFIX = "block_sparse_moe.experts."


class SkipInit(TorchFunctionMode):
    """Skip ``torch.nn.init`` calls: on the meta device they only cost time (seconds for the real K3)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


# ---- parameter shapes from the real modules ---------------------------------------------------------------------
@dataclass(frozen=True)
class ParamShape:
    """One parameter: its shape and whether it is an fp32 island (fp32 whatever the model dtype)."""

    name: str
    shape: tuple[int, ...]
    fp32: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def itemsize(self, dtype: torch.dtype) -> int:
        return 4 if self.fp32 else dtype.itemsize

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.numel * self.itemsize(dtype)

    def shard_nbytes(self, dtype: torch.dtype, world: int) -> int:
        """Bytes of one rank's FSDP2 shard: ``ceil(rows / world)`` rows (the padded first chunk, dim 0)."""
        rows = self.shape[0]
        return -(-rows // world) * (self.numel // rows) * self.itemsize(dtype)


@dataclass(frozen=True)
class DenseUnit:
    """A group of non-routed parameters that FSDP2 gathers together (or that stays replicated: ``shardable``)."""

    name: str
    params: tuple[ParamShape, ...]
    shardable: bool = True

    @cached_property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @cached_property
    def _fp32_numel(self) -> int:
        return sum(p.numel for p in self.params if p.fp32)

    def nbytes(self, dtype: torch.dtype) -> int:
        """Full (gathered) bytes."""
        return (self.numel - self._fp32_numel) * dtype.itemsize + self._fp32_numel * 4

    def held_nbytes(self, dtype: torch.dtype, world: int, sharded: bool) -> int:
        """Bytes a rank holds between gathers: its shard, or everything when replicated."""
        if not (sharded and self.shardable):
            return self.nbytes(dtype)
        return sum(p.shard_nbytes(dtype, world) for p in self.params)


@dataclass(frozen=True)
class TargetShapes:
    """The target's non-routed units in forward order and its routed parameters, from the real modules."""

    config: KimiK3TextConfig
    embedding: DenseUnit
    layers: tuple[DenseUnit, ...]
    lm_head: DenseUnit
    root: DenseUnit  # final norm + AttnRes output mixer: read outside any FSDP unit, replicated
    routed_per_expert: tuple[int, ...]  # routed weights of one expert, per decoder layer (0 for dense layers)
    _held: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def units(self) -> tuple[DenseUnit, ...]:
        return (self.embedding, *self.layers, self.lm_head, self.root)

    @property
    def routed_weights_per_expert(self) -> int:
        return sum(self.routed_per_expert)

    def dense_bytes(self, dtype: torch.dtype) -> int:
        return sum(u.nbytes(dtype) for u in self.units)

    def dense_held_bytes(self, dtype: torch.dtype, world: int, sharded: bool) -> int:
        key = (dtype, world, sharded)
        if key not in self._held:  # layers of one kind share their parameter tuple: size it once
            per_kind: dict[int, int] = {}
            for u in self.units:
                if id(u.params) not in per_kind:
                    per_kind[id(u.params)] = u.held_nbytes(dtype, world, sharded)
            self._held[key] = sum(per_kind[id(u.params)] for u in self.units)
        return self._held[key]


def _layer_parameters(config: KimiK3TextConfig, layer_idx: int) -> tuple[tuple[ParamShape, ...], int]:
    """(non-routed parameters, routed weights of one expert) of decoder layer ``layer_idx``, built on meta."""
    with torch.device("meta"), SkipInit():
        layer = K3DecoderLayer(config, layer_idx, expert_range=(0, 1))
    dense, routed = [], 0
    for name, p in layer.named_parameters():
        if name.startswith(ROUTED_PREFIX):
            routed += p.numel()
        else:
            dense.append(ParamShape(name, tuple(p.shape), is_fp32_parameter(name)))
    return tuple(dense), routed


def target_shapes(config: KimiK3TextConfig) -> TargetShapes:
    """Every non-routed parameter shape of the target and the routed weights per expert, one meta layer per kind."""
    kinds: dict[tuple[bool, bool], tuple[tuple[ParamShape, ...], int]] = {}
    layers, routed = [], []
    for i in range(config.num_hidden_layers):
        kind = (config.is_kda(i), config.is_moe(i))
        if kind not in kinds:
            kinds[kind] = _layer_parameters(config, i)
        params, per_expert = kinds[kind]
        layers.append(DenseUnit(f"layers.{i}", params))
        routed.append(per_expert)
    V, H = config.vocab_size, config.hidden_size
    embedding = DenseUnit("embed_tokens", (ParamShape("embed_tokens.weight", (V, H)),))
    head = () if config.tie_word_embeddings else (ParamShape("lm_head.weight", (V, H)),)
    root = [ParamShape("norm.weight", (H,))]
    if config.attn_res_block_size is not None:
        root += [ParamShape("output_attn_res_norm.weight", (H,)), ParamShape("output_attn_res_proj.weight", (1, H))]
    return TargetShapes(
        config=config,
        embedding=embedding,
        layers=tuple(layers),
        lm_head=DenseUnit("lm_head", head),
        root=DenseUnit("root", tuple(root), shardable=False),
        routed_per_expert=tuple(routed),
    )


def routed_bytes(routed_weights: int, dtype: torch.dtype, storage: str) -> int:
    """Bytes of ``routed_weights`` expert weights: MXFP4 (4 bits + one E8M0 byte per 32) or ``dtype``."""
    if storage == "mxfp4":
        return routed_weights // 2 + routed_weights // MXFP4_GROUP
    return routed_weights * dtype.itemsize


# ---- the target-weights report (printed by the strategy at setup) ---------------------------------------------
@dataclass(frozen=True)
class RankMemory:
    ep_size: int
    dtype: torch.dtype
    experts_per_rank: int
    non_routed_params: int  # replicated on every rank
    routed_params_per_rank: int
    non_routed_bytes: int
    routed_packed_bytes: int  # MXFP4: 4-bit values + one E8M0 scale byte per 32
    routed_dequantised_bytes: int  # in `dtype`, as loaded today

    @property
    def total_packed_bytes(self) -> int:
        return self.non_routed_bytes + self.routed_packed_bytes

    @property
    def total_dequantised_bytes(self) -> int:
        return self.non_routed_bytes + self.routed_dequantised_bytes

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (
            f"K3 target per rank at expert_parallel_size={self.ep_size} ({self.experts_per_rank} experts/layer): "
            f"non-routed {_size(self.non_routed_bytes)} ({dt}, one full copy), routed experts "
            f"{_size(self.routed_packed_bytes)} packed MXFP4 / {_size(self.routed_dequantised_bytes)} {dt}; "
            f"total {_size(self.total_packed_bytes)} packed / {_size(self.total_dequantised_bytes)} {dt}"
        )


def _size(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 1e6:.2f} MB"


def check_ep_size(config: KimiK3TextConfig, ep_size: int) -> None:
    E = config.num_experts
    if ep_size < 1 or E % ep_size:
        raise ValueError(f"num_experts ({E}) is not divisible by expert_parallel_size ({ep_size})")


def per_rank_memory_report(
    config: KimiK3TextConfig, ep_size: int, dtype: torch.dtype = torch.bfloat16, shapes: TargetShapes | None = None
) -> RankMemory:
    """Weight bytes one EP rank holds for the frozen target, dense weights replicated (activations, the draft and
    dense sharding are in :func:`lightning_eagle.planning.build_plan`)."""
    check_ep_size(config, ep_size)
    shapes = shapes or target_shapes(config)
    experts = config.num_experts // ep_size
    routed = shapes.routed_weights_per_expert * experts
    return RankMemory(
        ep_size=ep_size,
        dtype=dtype,
        experts_per_rank=experts,
        non_routed_params=sum(u.numel for u in shapes.units),
        routed_params_per_rank=routed,
        non_routed_bytes=shapes.dense_bytes(dtype),
        routed_packed_bytes=routed_bytes(routed, dtype, "mxfp4"),
        routed_dequantised_bytes=routed_bytes(routed, dtype, "dequantized"),
    )


def memory_table(config: KimiK3TextConfig, ep_sizes: list[int], dtype: torch.dtype = torch.bfloat16) -> str:
    """Markdown table of :func:`per_rank_memory_report` for several EP sizes (`docs/scaling.md`)."""
    dt = str(dtype).removeprefix("torch.")
    shapes = target_shapes(config)
    rows = [
        f"| EP | experts/rank | non-routed ({dt}) | routed MXFP4 packed | routed {dt} | total packed | total {dt} |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ep in ep_sizes:
        m = per_rank_memory_report(config, ep, dtype, shapes)
        rows.append(
            f"| {ep} | {m.experts_per_rank} | {m.non_routed_bytes / GB:.1f} GB | {m.routed_packed_bytes / GB:.1f} GB | "
            f"{m.routed_dequantised_bytes / GB:.1f} GB | {m.total_packed_bytes / GB:.1f} GB | "
            f"{m.total_dequantised_bytes / GB:.1f} GB |"
        )
    return "\n".join(rows)
