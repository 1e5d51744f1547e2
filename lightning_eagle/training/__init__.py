"""Draft training, every family: what the LightningModules share (``training/draft_training.py``, the registry of the
families' modules), the EAGLE-3 math exported here (shift, teacher, loss, the TTT unroll and its metrics; its module
``Eagle3Module`` in ``training/module.py``) and the DSpark block objective (the ``dspark_*`` modules, ``DSparkModule``).
Every name is imported on first use, so importing a shared module of this package loads no family's code."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "TTTMetrics": "lightning_eagle.training.metrics",  # torchmetrics costs seconds to import (and pulls transformers)
    "TTTOutput": "lightning_eagle.training.ttt",
    "Teacher": "lightning_eagle.training.teacher",
    "compute_teacher": "lightning_eagle.training.teacher",
    "draft_step": "lightning_eagle.training.ttt",
    "shift_left": "lightning_eagle.training.shift",
    "shift_target_outputs": "lightning_eagle.training.shift",
    "soft_cross_entropy": "lightning_eagle.training.loss",
    "step_weights": "lightning_eagle.training.loss",
    "tau_sim": "lightning_eagle.training.ttt",
    "teacher_from_hidden": "lightning_eagle.training.teacher",
    "teacher_from_logits": "lightning_eagle.training.teacher",
    "ttt_loss": "lightning_eagle.training.ttt",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover — what IDEs and type checkers see; keep it equal to _EXPORTS
    from lightning_eagle.training.loss import soft_cross_entropy, step_weights
    from lightning_eagle.training.metrics import TTTMetrics
    from lightning_eagle.training.shift import shift_left, shift_target_outputs
    from lightning_eagle.training.teacher import Teacher, compute_teacher, teacher_from_hidden, teacher_from_logits
    from lightning_eagle.training.ttt import TTTOutput, draft_step, tau_sim, ttt_loss


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
