"""K3 RMSNorm: fp32 variance, cast back to the input dtype *before* the weight, no (1 + w) offset."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # Weight after the cast: bf16 weights give bf16 outputs, fp32 weights promote (K3 convention).
    return normed if weight is None else weight * normed


class K3RMSNorm(nn.Module):
    """RMSNorm as K3 computes it. The target's MLA latent norms use eps 1e-6, everything else ``rms_norm_eps``."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
