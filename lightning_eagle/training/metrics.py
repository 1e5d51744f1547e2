"""Acceptance metrics of the TTT unroll as a torchmetrics ``Metric`` (`eagle3_training.md` §7).

All states are int64 *counts* reduced across ranks by sum; ratios are formed only in ``compute`` (averaging per-rank
ratios would weight ranks wrongly). Per step k:

* ``acc_k = Σ correct_k / Σ pos_k`` (conditional on the true previous tokens — not an acceptance rate);
* ``tau_sim = 1 + Σ_k Σ hit_k / Σ valid_k`` with ``hit_k = AND_{j≤k} correct_j`` and ``valid_k = AND_{j≤k} lm_j``:
  a greedy target token outside the draft vocabulary breaks the chain but stays in ``valid``.

Usage in a LightningModule: create in ``__init__`` (never under a meta-device context), ``metric.update(out)`` with
the :class:`~lightning_eagle.training.TTTOutput` of each batch, then at epoch end
``self.log_dict({f"val/{k}": v for k, v in metric.compute().items()})`` and ``metric.reset()``.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from lightning_eagle.training.ttt import tau_sim

_STATES = ("correct", "supervised", "hits", "chain_valid")


class TTTMetrics(Metric):
    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, ttt_steps: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ttt_steps = ttt_steps
        for name in _STATES:
            self.add_state(name, default=torch.zeros(ttt_steps, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, output) -> None:
        """``output``: a ``TTTOutput`` (or anything with its four count fields, each ``[K]``)."""
        counts = (output.per_step_correct, output.per_step_valid, output.step_prefix_hits, output.step_valid)
        for name, value in zip(_STATES, counts):
            if value.shape != (self.ttt_steps,):
                raise ValueError(f"{name}: expected shape ({self.ttt_steps},), got {tuple(value.shape)}")
            setattr(self, name, getattr(self, name) + value.detach().to(torch.long))

    def compute(self) -> dict[str, torch.Tensor]:
        acc = self.correct.double() / self.supervised.double().clamp_min(1)
        result = {f"acc_{k}": acc[k].float() for k in range(self.ttt_steps)}
        result["accuracy"] = (self.correct.sum().double() / self.supervised.sum().double().clamp_min(1)).float()
        result["tau_sim"] = tau_sim(self.hits, self.chain_valid)
        return result
