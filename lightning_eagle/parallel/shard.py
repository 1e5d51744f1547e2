"""How the frozen K3 target is split over an expert-parallel group.

Only routed experts are sharded (``k3_target.md`` §5.1): EP rank ``r`` of ``ep`` owns the contiguous experts
``[r·E/ep, (r+1)·E/ep)`` of every MoE layer; everything else is replicated. The loader reads only that slice
(``KimiK3ForCausalLM.from_pretrained(..., expert_range=expert_range(E, ep, r))``) and :func:`enable_expert_parallel`
then swaps every MoE layer's single-process ``dispatch`` for a distributed one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_eagle.k3.experts import RoutedExperts
from lightning_eagle.k3.moe import K3SparseMoE


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """``(start, count)`` of the routed experts EP rank ``ep_rank`` holds: a contiguous, equal slice."""
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"expert_parallel_size must be a positive int, got {ep_size!r}")
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts ({num_experts}) is not divisible by expert_parallel_size ({ep_size}); each rank must hold "
            "a contiguous, equal slice of routed experts"
        )
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} is outside the expert-parallel group of size {ep_size}")
    count = num_experts // ep_size
    return ep_rank * count, count


def check_expert_slice(experts: RoutedExperts, ep_size: int, ep_rank: int, name: str = "experts") -> None:
    """A layer must hold exactly this rank's slice; anything else would silently drop or double-count experts."""
    want = expert_range(experts.num_experts, ep_size, ep_rank)
    got = (experts.start, experts.count)
    if got != want:
        raise RuntimeError(
            f"{name} holds experts [{got[0]}, {got[0] + got[1]}) of {experts.num_experts}, but EP rank {ep_rank} of "
            f"{ep_size} must hold [{want[0]}, {want[0] + want[1]}); load the target with "
            f"expert_range={want}"
        )


def moe_layers(model: nn.Module) -> list[tuple[str, K3SparseMoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, K3SparseMoE)]


def enable_expert_parallel(model: nn.Module, dispatcher: Callable, ep_size: int, ep_rank: int) -> list[str]:
    """Install ``dispatcher`` on every MoE layer after checking that each holds EP rank ``ep_rank``'s slice.

    Every layer is checked before any is changed, so a mismatch leaves the model untouched. Returns the names of the
    MoE layers. With ``ep_size == 1`` the complete experts need no dispatcher and the model is left as it is.
    """
    layers = moe_layers(model)
    for name, moe in layers:
        check_expert_slice(moe.experts, ep_size, ep_rank, f"{name}.experts")
    if ep_size > 1:
        for _, moe in layers:
            moe.dispatch = dispatcher
    return [name for name, _ in layers]


def routed_expert_bytes(model: nn.Module) -> int:
    """Bytes of routed-expert weights this process holds (what EP divides by ``ep_size``)."""
    return sum(
        t.numel() * t.element_size()
        for m in model.modules()
        if isinstance(m, RoutedExperts)
        for t in m.stored_tensors()
        if t.device != torch.device("meta")
    )
