"""The left shift with zero fill (`eagle3_training.md` §2): ``shift(x)[t] = x[t+1]``, ``shift(x)[T-1] = 0``.

Applied once to the target's outputs (final hidden / logits), ``input_ids`` and ``loss_mask`` before the unroll, and
once more per TTT step to ``ids`` / teacher / position mask / loss gate. ``aux_hidden_states`` and
``attention_mask`` are never shifted, nor is the draft's recurrent hidden state.
"""

from __future__ import annotations

import torch


def shift_left(x: torch.Tensor, steps: int = 1, dim: int = 1) -> torch.Tensor:
    """``x`` moved ``steps`` positions towards the start along ``dim``; the vacated tail is zero (False for bool)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if steps == 0:
        return x
    length = x.shape[dim]
    keep = max(length - steps, 0)
    tail_shape = list(x.shape)
    tail_shape[dim] = length - keep
    tail = torch.zeros(tail_shape, dtype=x.dtype, device=x.device)
    return torch.cat([x.narrow(dim, length - keep, keep), tail], dim=dim)


def shift_target_outputs(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, target_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-token shift between the target forward and the TTT unroll: ids, loss mask and the target's final
    hidden (or logits) move left by one, so that slot t holds x_{t+1}, gate ``loss_mask[t+1]`` and the target's
    prediction of x_{t+2}."""
    return shift_left(input_ids), shift_left(loss_mask), shift_left(target_output)
