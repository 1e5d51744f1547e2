"""K3's latent MoE block: route on the full-width input, run routed experts at the latent width, fp32 weighted sum,
latent RMSNorm, up-projection, plus shared experts on the original input."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.experts import RoutedExperts
from lightning_eagle.k3.router import K3Router
from lightning_eagle.ops.norm import K3RMSNorm
from lightning_eagle.ops.situ import SituMLP


class ExpertDispatcher(Protocol):
    """Computes ``Σ_j w_j·y_{e_j}`` (fp32 ``[N,H_l]``) for every token, whichever rank holds the experts."""

    def __call__(
        self, experts: RoutedExperts, z: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor
    ) -> torch.Tensor: ...


def local_dispatch(experts: RoutedExperts, z: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor):
    """Single process: every expert is local. A partial slice without a distributed dispatcher is an error,
    because silently dropping the remote experts' contributions would compute garbage."""
    if not experts.is_complete:
        raise RuntimeError(
            f"this MoE layer holds experts [{experts.start}, {experts.start + experts.count}) of "
            f"{experts.num_experts}; run it under ExpertParallelStrategy (a distributed dispatcher) or load all experts"
        )
    return experts(z, topk_idx, topk_weight)


class K3SparseMoE(nn.Module):
    """``block_sparse_moe``: router, latent down/up projections, routed experts, latent norm and shared experts."""

    def __init__(
        self, config: KimiK3TextConfig, expert_range: tuple[int, int] | None = None, expert_storage: str = "dequantized"
    ) -> None:
        super().__init__()
        H, Hl = config.hidden_size, config.expert_hidden_size
        betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
        self.gate = K3Router(config)
        self.latent = config.routed_expert_hidden_size is not None
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(H, Hl, bias=False)
            self.routed_expert_up_proj = nn.Linear(Hl, H, bias=False)
            self.routed_expert_norm = K3RMSNorm(Hl, eps=config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.experts = RoutedExperts(
            config.num_experts, Hl, config.moe_intermediate_size, expert_range, *betas, storage=expert_storage
        )
        self.shared_experts = (
            SituMLP(H, config.num_shared_experts * config.moe_intermediate_size, *betas)
            if config.num_shared_experts
            else None
        )
        self.dispatch: ExpertDispatcher = local_dispatch
        self.last_routing: tuple[torch.Tensor, torch.Tensor] | None = None
        self.record_routing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topk_idx, topk_weight = self.gate(x)
        if self.record_routing:
            self.last_routing = (topk_idx, topk_weight)
        z = self.routed_expert_down_proj(x) if self.latent else x
        r = self.dispatch(self.experts, z, topk_idx, topk_weight).to(x.dtype)  # cast the fp32 sum once
        if self.latent:
            if self.routed_expert_norm is not None:
                r = self.routed_expert_norm(r)  # after the weighted sum, before the up-projection
            r = self.routed_expert_up_proj(r)
        if self.shared_experts is not None:
            r = r + self.shared_experts(x)
        return r.view(shape)
