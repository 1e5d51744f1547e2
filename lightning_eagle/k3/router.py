"""K3's MoE router (``noaux_tc``): fp32 sigmoid scores, correction bias for *selection only*, renormalised weights."""

from __future__ import annotations

import torch
from torch import nn

from lightning_eagle.k3.config import KimiK3TextConfig


class K3Router(nn.Module):
    """``gate.weight [E,H]`` and ``gate.e_score_correction_bias [E]`` (fp32, frozen, never updated online)."""

    def __init__(self, config: KimiK3TextConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))
        self.activation = config.moe_router_activation_func
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.num_groups, self.topk_groups = config.num_expert_group, config.topk_group

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N,H]`` → ``(topk_idx [N,k] int64, topk_weight [N,k] fp32)``."""
        # fp32 even under autocast: bf16 routing flips expert choices.
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = x.float() @ self.weight.float().t()
        scores = torch.sigmoid(logits) if self.activation == "sigmoid" else torch.softmax(logits, dim=-1)
        biased = scores + self.e_score_correction_bias.float()
        if self.num_groups > 1 and self.num_groups > self.topk_groups:
            biased = self._limit_groups(biased)
        topk_idx = torch.topk(biased, self.top_k, dim=-1).indices
        weights = scores.gather(-1, topk_idx)  # the *unbiased* scores
        if self.top_k > 1 and self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return topk_idx, weights * self.scaling

    def _limit_groups(self, biased: torch.Tensor) -> torch.Tensor:
        N, E = biased.shape
        grouped = biased.view(N, self.num_groups, E // self.num_groups)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(self.topk_groups, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)
