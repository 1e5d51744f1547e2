"""A progress bar that counts optimizer steps when training is bounded by ``max_steps``.

Lightning's bar reads "Epoch 0/-2" for step-bounded runs (``max_epochs=-1``), which tells a new user nothing.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class StepProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training label is ``Epoch e · step s/max_steps`` (or ``Epoch e/E`` by epochs)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if trainer.max_steps and trainer.max_steps > 0:
            text = f"Epoch {current_epoch} · step {trainer.global_step}/{trainer.max_steps}"
        elif trainer.max_epochs is not None and trainer.max_epochs > 0:
            text = f"Epoch {current_epoch}/{trainer.max_epochs - 1}"
        else:
            text = f"Epoch {current_epoch}"
        return f"{text:{len(self.validation_description)}}"

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.progress is not None and self.train_progress_bar_id is not None and not self.is_disabled:
            self.progress.update(
                self.train_progress_bar_id, description=self._get_train_description(trainer.current_epoch)
            )
