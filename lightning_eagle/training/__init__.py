"""Draft training for both families. Exported here: the EAGLE-3 math (shift, teacher, loss, the TTT unroll and its
metrics). The DSpark block objective lives in the ``dspark_*`` modules; the LightningModules are ``Eagle3Module``
(``training/module.py``) and ``DSparkModule`` (``training/dspark_module.py``), over what they share
(``training/draft_training.py``)."""

from typing import TYPE_CHECKING

from lightning_eagle.training.loss import soft_cross_entropy, step_weights
from lightning_eagle.training.shift import shift_left, shift_target_outputs
from lightning_eagle.training.teacher import Teacher, compute_teacher, teacher_from_hidden, teacher_from_logits
from lightning_eagle.training.ttt import TTTOutput, draft_step, tau_sim, ttt_loss

__all__ = [
    "TTTMetrics",
    "TTTOutput",
    "Teacher",
    "compute_teacher",
    "draft_step",
    "shift_left",
    "shift_target_outputs",
    "soft_cross_entropy",
    "step_weights",
    "tau_sim",
    "teacher_from_hidden",
    "teacher_from_logits",
    "ttt_loss",
]


if TYPE_CHECKING:  # pragma: no cover
    from lightning_eagle.training.metrics import TTTMetrics


def __getattr__(name: str):
    # torchmetrics costs seconds to import (and pulls transformers); load it only when the metric is used.
    if name == "TTTMetrics":
        from lightning_eagle.training import metrics

        return getattr(metrics, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
