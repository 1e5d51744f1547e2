"""SiTU gated MLP: SiLU whose linear factor is soft-capped to ±β, times a soft-capped up branch."""

from __future__ import annotations

import torch
from torch import nn


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """``β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)`` in fp32, cast back to the input dtype.

    ``beta=None`` / ``linear_beta=None`` drop the corresponding cap (both None is SwiGLU).
    """
    g, u = gate.float(), up.float()
    linear = g if beta is None else beta * torch.tanh(g / beta)
    a = linear * torch.sigmoid(g)  # the sigmoid sees the uncapped gate
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


class SituMLP(nn.Module):
    """``down_proj(SiTU(gate_proj(x), up_proj(x)))``; used by dense layer 0, shared experts and the draft."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, beta: float | None = 4.0, linear_beta: float | None = 25.0
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_and_mul(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))
