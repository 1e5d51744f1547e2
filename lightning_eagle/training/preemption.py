"""SIGTERM (how a cluster scheduler preempts) or Ctrl+C during ``fit``: finish the optimizer step in flight, save a
resumable checkpoint, say where, and exit with ``128 + signal`` (143, 130), never 0.

Lightning's own handler only sets ``trainer.received_sigterm``, and its loops then end the run with a
``SystemExit`` of status 0 at the next epoch or validation boundary, saving nothing. This callback replaces the
SIGTERM/SIGINT handlers once training starts. The signal is only noted; the save happens between optimizer steps (a
checkpoint mid-accumulation would lose the accumulated gradients), after the validation in flight ends, exactly where
``ModelCheckpoint(every_n_train_steps=…)`` would save, so ``--ckpt_path`` resumes it exactly. Every rank agrees on the
stop through one all-reduce of a flag per optimizer step. A second Ctrl+C interrupts at once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_eagle.errors import RunError

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)
CHECKPOINT_NAME = "last.ckpt"  # what `--ckpt_path last` finds


class Preempted(RunError):
    """The run was stopped by a signal; ``exit_status`` is the shell's ``128 + signal``."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_status = 128 + signum


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM/SIGINT during ``fit``: a resumable checkpoint at the next optimizer-step boundary, then
    :class:`Preempted`. ``dirpath=None`` = the run's ``ModelCheckpoint`` folder (else ``<root>/checkpoints``)."""

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._step_seen = -1

    def _note(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl+C: the user wants out now
        self.received = signum

    def _install(self, trainer: pl.Trainer) -> None:
        if self._previous:
            return
        if getattr(trainer, "received_sigterm", False):  # arrived between Lightning's handler and ours
            self.received = signal.SIGTERM
        for signum in PREEMPTION_SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._note)
            except ValueError:  # not the main thread (a notebook's worker): leave the defaults
                return

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)
        self._step_seen = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._step_seen:  # an optimizer step just ended: a resumable point
            self._step_seen = trainer.global_step
            self._stop_if_asked(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._stop_if_asked(trainer)

    def _stop_if_asked(self, trainer: pl.Trainer) -> None:
        flag = torch.tensor(float(self.received or 0), device=trainer.strategy.root_device)
        signum = int(trainer.strategy.reduce(flag, reduce_op="max"))
        if not signum:
            return
        name = signal.Signals(signum).name
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        raise Preempted(
            f"fit stopped by {name} after global step {trainer.global_step}: a resumable checkpoint is at {path}; "
            f"continue with --ckpt_path {path} (nothing was exported)",
            signum,
        )

    def checkpoint_path(self, trainer: pl.Trainer) -> Path:
        folder = self.dirpath
        if folder is None:
            folder = next((c.dirpath for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
        return Path(folder or Path(trainer.default_root_dir) / "checkpoints") / CHECKPOINT_NAME

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()
