"""Attention Residuals: each sub-layer reads a softmax mixture of committed block sums (the bank) and the running
in-block prefix, with a static per-layer query ``norm.weight ⊙ proj.weight[0]``.

The ``*_res_norm`` / ``*_res_proj`` modules only hold weights (checkpoint names); they are never called, so forward
hooks on them never fire.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_eagle.ops.norm import K3RMSNorm


def attn_res_mix(prefix: torch.Tensor, bank: list[torch.Tensor], norm: K3RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """``Mix(p, bank)``: all math fp32, output in the prefix's dtype."""
    values = torch.stack([*bank, prefix], dim=-2).float()  # [..., m+1, H], prefix LAST
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + norm.eps)  # weightless RMS normalisation
    query = norm.weight.float() * proj.weight[0].float()
    pi = torch.softmax(keys @ query, dim=-1)
    return (pi[..., None] * values).sum(-2).to(prefix.dtype)  # a mix of the UN-normalised values


def res_weights(hidden_size: int, eps: float) -> tuple[K3RMSNorm, nn.Linear]:
    """The (norm, proj) weight holders of one mixer; a zero ``proj`` gives a uniform average."""
    proj = nn.Linear(hidden_size, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return K3RMSNorm(hidden_size, eps=eps), proj
