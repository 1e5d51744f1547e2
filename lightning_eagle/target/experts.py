"""Routed experts stored stacked, holding a contiguous slice ``[start, start + n)`` of the global experts.

Stacked layout (the grouped-GEMM order): ``gate_up_proj [n, H_l, 2I] = [w1ᵀ | w3ᵀ]`` (gate half first) and
``down_proj [n, I, H_l] = w2ᵀ``. Each expert output is rounded to the model dtype before weighting; the weighted sum
is fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_eagle.ops.situ import situ_and_mul


class RoutedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        expert_range: tuple[int, int] | None = None,
        beta: float | None = 4.0,
        linear_beta: float | None = 25.0,
    ) -> None:
        super().__init__()
        start, count = expert_range if expert_range is not None else (0, num_experts)
        if not (0 <= start and count >= 1 and start + count <= num_experts):
            raise ValueError(f"expert_range {expert_range} is not a slice of the {num_experts} experts")
        self.num_experts, self.start, self.count = num_experts, start, count
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(count, hidden_size, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(count, intermediate_size, hidden_size))
        self.beta, self.linear_beta = beta, linear_beta

    @property
    def is_complete(self) -> bool:
        return self.count == self.num_experts

    def expert(self, local: int, z: torch.Tensor) -> torch.Tensor:
        """One expert on ``z [n_tok, H_l]`` → model-dtype output ``[n_tok, H_l]``."""
        gate, up = (z @ self.gate_up_proj[local]).split(self.intermediate_size, dim=-1)
        return situ_and_mul(gate, up, self.beta, self.linear_beta) @ self.down_proj[local]

    def forward(self, z: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Grouped path: tokens sorted by expert, one GEMM pair per local expert. Returns the fp32 partial sum
        ``Σ_j w_j · y_{e_j}`` over the (token, slot) pairs routed to *local* experts, ``[N, H_l]``."""
        N, k = topk_idx.shape
        out = torch.zeros(N, z.shape[-1], dtype=torch.float32, device=z.device)
        local = topk_idx - self.start
        flat_local = local.reshape(-1)
        is_local = (flat_local >= 0) & (flat_local < self.count)
        pairs = is_local.nonzero().squeeze(-1)
        if pairs.numel() == 0:
            return out
        order = flat_local[pairs].argsort(stable=True)
        pairs = pairs[order]
        experts = flat_local[pairs]
        tokens = pairs // k
        counts = torch.bincount(experts, minlength=self.count).tolist()
        z_sorted = z[tokens]
        y = torch.empty_like(z_sorted)
        offset = 0
        for e, c in enumerate(counts):
            if c:
                y[offset : offset + c] = self.expert(e, z_sorted[offset : offset + c])
            offset += c
        weights = topk_weight.reshape(-1)[pairs].float()
        out.index_add_(0, tokens, y.float() * weights[:, None])
        return out

    def forward_naive(self, z: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Readable twin of :meth:`forward`: a plain loop over local experts with boolean masks."""
        out = torch.zeros(z.shape[0], z.shape[-1], dtype=torch.float32, device=z.device)
        for e in range(self.count):
            hit = topk_idx == self.start + e  # [N,k]
            rows = hit.any(-1)
            if rows.any():
                y = self.expert(e, z[rows]).float()
                w = (topk_weight * hit).sum(-1)[rows].float()
                out[rows] += w[:, None] * y
        return out
