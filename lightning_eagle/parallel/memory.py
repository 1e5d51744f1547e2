"""Per-rank weight memory of the frozen K3 target under expert parallelism, computed from a config alone.

Parameter counts come from the real module tree (one decoder layer of each kind built on the meta device, with
``nn.init`` skipped), not from a second hand-written formula, so the report cannot drift from the model. Bytes:

* non-routed weights (replicated on every rank): model dtype, except the fp32-kept tensors (``A_log``, ``dt_bias``,
  router bias, conv weights, ``o_norm``);
* routed experts per rank: ``E/ep`` experts × layers, either packed MXFP4 (0.5 B + 1 scale byte per 32 weights)
  or dequantised to the model dtype — what :class:`~lightning_eagle.k3.experts.RoutedExperts` holds today.

For the published K3 at EP 8 / 32 / 64 this reproduces ``k3_target.md`` §5.3: ≈ 113 GB non-routed (bf16) and
181 / 45 / 22.6 GB packed, 681 / 170 / 85 GB bf16 routed experts per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from lightning_eagle.k3.config import MXFP4_GROUP, KimiK3TextConfig
from lightning_eagle.k3.layer import K3DecoderLayer
from lightning_eagle.k3.model import is_fp32_parameter

GB = 1e9  # decimal, as in the spec's tables


class _SkipInit(TorchFunctionMode):
    """Skip ``torch.nn.init`` calls: on the meta device they only cost time (seconds for the real K3)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


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
            f"non-routed {_size(self.non_routed_bytes)} ({dt}, replicated), routed experts "
            f"{_size(self.routed_packed_bytes)} packed MXFP4 / {_size(self.routed_dequantised_bytes)} {dt}; "
            f"total {_size(self.total_packed_bytes)} packed / {_size(self.total_dequantised_bytes)} {dt}"
        )


def _size(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 1e6:.2f} MB"


def _layer_counts(config: KimiK3TextConfig, layer_idx: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(non-routed params, non-routed bytes, routed params per expert) of decoder layer ``layer_idx``."""
    with torch.device("meta"), _SkipInit():
        layer = K3DecoderLayer(config, layer_idx, expert_range=(0, 1))
    params = bytes_ = routed = 0
    for name, p in layer.named_parameters():
        if name.startswith("block_sparse_moe.experts."):
            routed += p.numel()
        else:
            params += p.numel()
            bytes_ += p.numel() * (4 if is_fp32_parameter(name) else dtype.itemsize)
    return params, bytes_, routed


def per_rank_memory_report(config: KimiK3TextConfig, ep_size: int, dtype: torch.dtype = torch.bfloat16) -> RankMemory:
    """Weight bytes one EP rank holds for the frozen target (activations and the draft are not included)."""
    E = config.num_experts
    if ep_size < 1 or E % ep_size:
        raise ValueError(f"num_experts ({E}) is not divisible by expert_parallel_size ({ep_size})")
    kinds: dict[tuple[bool, bool], tuple[int, int, int]] = {}
    non_routed = non_routed_bytes = routed_per_expert = 0
    for i in range(config.num_hidden_layers):
        kind = (config.is_kda(i), config.is_moe(i))
        if kind not in kinds:
            kinds[kind] = _layer_counts(config, i, dtype)
        params, bytes_, routed = kinds[kind]
        non_routed += params
        non_routed_bytes += bytes_
        routed_per_expert += routed
    # Outside the layers: embedding, lm_head (unless tied), final norm and the AttnRes output mixer.
    H = config.hidden_size
    top = config.vocab_size * H * (1 if config.tie_word_embeddings else 2) + H
    if config.attn_res_block_size is not None:
        top += 2 * H
    non_routed += top
    non_routed_bytes += top * dtype.itemsize
    routed = routed_per_expert * (E // ep_size)
    return RankMemory(
        ep_size=ep_size,
        dtype=dtype,
        experts_per_rank=E // ep_size,
        non_routed_params=non_routed,
        routed_params_per_rank=routed,
        non_routed_bytes=non_routed_bytes,
        routed_packed_bytes=routed // 2 + routed // MXFP4_GROUP,
        routed_dequantised_bytes=routed * dtype.itemsize,
    )


def memory_table(config: KimiK3TextConfig, ep_sizes: list[int], dtype: torch.dtype = torch.bfloat16) -> str:
    """Markdown table of :func:`per_rank_memory_report` for several EP sizes (README "Scaling out")."""
    dt = str(dtype).removeprefix("torch.")
    rows = [
        f"| EP | experts/rank | non-routed ({dt}) | routed MXFP4 packed | routed {dt} | total packed | total {dt} |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ep in ep_sizes:
        m = per_rank_memory_report(config, ep, dtype)
        rows.append(
            f"| {ep} | {m.experts_per_rank} | {m.non_routed_bytes / GB:.1f} GB | {m.routed_packed_bytes / GB:.1f} GB | "
            f"{m.routed_dequantised_bytes / GB:.1f} GB | {m.total_packed_bytes / GB:.1f} GB | "
            f"{m.total_dequantised_bytes / GB:.1f} GB |"
        )
    return "\n".join(rows)
