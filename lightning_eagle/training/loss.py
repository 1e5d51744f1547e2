"""Per-step loss and step weights (`eagle3_training.md` §6). Both are plain functions so that a training module
can swap them (``ttt_loss(step_loss_fn=..., step_weights_fn=...)``) for research variants, e.g. LK losses."""

from __future__ import annotations

import math

import torch

from lightning_eagle.settings import DEFAULT_STEP_DECAY


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
    """``L_k = Σ pos · (−Σ_v p_t · log_softmax(z)) / max(1, Σ pos)`` — divided by the number of supervised positions
    (not B·T, so padding density cannot change the loss scale). An all-masked step is 0 with zero gradient.

    ``logits [..., N_d]`` (any dtype; fp32 log-softmax), ``target_probs`` the same shape (fp32, detached),
    ``position_mask [...]`` bool.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    per_position = -(target_probs * log_probs).sum(-1)
    mask = position_mask.to(torch.bool)
    total = torch.where(mask, per_position, torch.zeros_like(per_position)).sum()
    return total / mask.sum().clamp_min(1)


def step_weights(ttt_steps: int, decay: float = DEFAULT_STEP_DECAY) -> torch.Tensor:
    """``decay**k`` for k = 0..K−1 (fp32); the unroll divides by their sum so the loss scale does not depend on K."""
    if not isinstance(ttt_steps, int) or ttt_steps < 1:
        raise ValueError(f"ttt_steps must be an int >= 1, got {ttt_steps!r}")
    return torch.tensor([decay**k for k in range(ttt_steps)], dtype=torch.float32)


def block_slot_weights(block_size: int, decay: float) -> torch.Tensor:
    """DSpark's per-slot weights ``exp(−k / decay)`` for k = 0..g−1 (fp32; DeepSpec's ``loss_decay_gamma``, 4.0 in
    every public config: faster than the paper's ``exp(−(k−1)/g)``). Not normalised: the objective divides by the
    weighted count of its supervised slots."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if not (isinstance(decay, (int, float)) and not isinstance(decay, bool) and math.isfinite(decay) and decay > 0):
        raise ValueError(f"the slot-weight decay must be a finite number > 0, got {decay!r}")
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / float(decay))
