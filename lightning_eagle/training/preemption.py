"""SIGTERM (how a cluster scheduler preempts) or Ctrl+C at any stage of ``fit``: a one-line message saying what was
interrupted and what to rerun, and exit status ``128 + signal`` (143, 130), never 0 and never a silent death.

Lightning's own handler only sets ``trainer.received_sigterm``, and its loops then end the run with a
``SystemExit`` of status 0 at the next epoch or validation boundary, saving nothing; a Ctrl+C becomes its
``KeyboardInterrupt`` handling and exit status 1. This callback owns SIGTERM/SIGINT from its ``setup`` hook (before
the target is loaded) to its ``teardown`` hook (after the fit-end export), and acts by stage:

* loading (the data module's set-up ends, the target loads, the run's state is restored, the sanity check):
  nothing is trained yet; the run stops at once (:class:`Interrupted`), saving nothing: rerun the same command.
* training: the signal is only noted; the save happens between optimizer steps (a checkpoint mid-accumulation would
  lose the accumulated gradients), exactly where ``ModelCheckpoint(every_n_train_steps=…)`` would save, so
  ``--ckpt_path`` resumes it exactly. Every rank agrees on the stop through one all-reduce of a flag per optimizer
  step. A second Ctrl+C stops at once, saving nothing more.
* validation inside ``fit`` (acceptance decoding included, which can take minutes): the validation stops at once
  (a scheduler's grace period is ~30 s), and the weights of the last optimizer step are saved as after a finished
  validation (the cut validation is not rerun on resume). With several ranks the signal is only noted, as in
  training, and the stop waits for the validation's end: ranks that do not decode already wait in the next step's
  collectives, so one rank cannot stop and save alone.
* after training (the fit-end export, :class:`~lightning_eagle.training.export_callback.ExportDraftCallback`): the
  run stops at once; the export leaves no partial folder and names the ``cli.py export`` command to rerun.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_eagle.errors import RunError

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)
CHECKPOINT_NAME = "last.ckpt"  # what `--ckpt_path last` finds
LOADING, TRAINING, VALIDATING, FINISHING = "loading", "training", "validating", "finishing"


class Preempted(RunError):
    """The run was stopped by a signal; ``exit_status`` is the shell's ``128 + signal``."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_status = 128 + signum


class Interrupted(BaseException):
    """A signal stopped the run at once, wherever it was (raised by the signal handler, like ``KeyboardInterrupt``,
    and like it not an ``Exception``, so no ``except Exception`` on the way swallows it). ``str()`` is the one-line
    message; ``exit_status`` is ``128 + signum``; ``checkpoint``: where a resumable checkpoint is to be saved on the
    way out (None: nothing to save)."""

    def __init__(self, message: str, signum: int, checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.signum, self.exit_status, self.checkpoint = signum, 128 + signum, checkpoint


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def checkpoint_path(trainer: pl.Trainer, dirpath: str | None = None) -> Path:
    """``<dirpath>/last.ckpt``; ``dirpath=None``: the run's ``ModelCheckpoint`` folder, else ``<root>/checkpoints``."""
    folder = dirpath
    if folder is None:
        folder = next((c.dirpath for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
    return Path(folder or Path(trainer.default_root_dir) / "checkpoints") / CHECKPOINT_NAME


@contextlib.contextmanager
def signals_interrupt(stop: Callable[[int], Interrupted]) -> Iterator[None]:
    """Inside the block, SIGTERM/SIGINT raise ``stop(signum)`` at once (the previous handlers come back after it).
    Off the main thread (where handlers cannot be set) the block runs with the handlers as they are."""
    previous: dict[int, object] = {}

    def handler(signum: int, frame) -> None:
        raise stop(signum)

    try:
        for signum in PREEMPTION_SIGNALS:
            previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM/SIGINT during ``fit``: what the module docstring says for the stage the run is in; a resumable
    checkpoint goes to ``dirpath`` (None = the run's ``ModelCheckpoint`` folder, else ``<root>/checkpoints``)."""

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.received: int | None = None
        self.stage: str | None = None
        self._previous: dict[int, object] = {}
        self._step_seen = -1
        self._trainer: pl.Trainer | None = None

    # ---- the handler ----------------------------------------------------------------------------------------------
    def _note(self, signum: int, frame) -> None:
        trainer, name = self._trainer, signal_name(signum)
        if self.stage is None or trainer is None:  # the fit is over (an exception left us installed): as before
            return self._pass_on(signum, frame)
        if self.stage == LOADING:
            resume = f" (it resumes from {trainer.ckpt_path} again)" if trainer.ckpt_path else ""
            raise Interrupted(
                f"fit interrupted by {name} before training started (loading the target, the data or the run's "
                f"state, or the sanity check): nothing was trained or saved; rerun the same cli.py fit command{resume}",
                signum,
            )
        if self.stage == TRAINING or (self.stage == VALIDATING and trainer.world_size > 1):
            if self.received is not None and signum == signal.SIGINT:  # a second Ctrl+C: the user wants out now
                raise Interrupted(
                    f"fit stopped at once by a second SIGINT at global step {trainer.global_step}: nothing was saved "
                    f"by this stop; resume from the run's last checkpoint (--ckpt_path last) if it has one",
                    signum,
                )
            self.received = signum
            return None
        if self.stage == VALIDATING:
            self.received, path = signum, self.checkpoint_path(trainer)
            raise Interrupted(
                f"fit stopped by {name} during validation after global step {trainer.global_step} (the validation "
                f"was cut short): a resumable checkpoint is at {path}; continue with --ckpt_path {path} (nothing was "
                f"exported)",
                signum,
                checkpoint=path,
            )
        raise Interrupted(  # FINISHING: the export (its own handler says more) or another fit-end step
            f"fit interrupted by {name} after training ended (global step {trainer.global_step}), while finishing "
            f"the run: its export may be missing; export a checkpoint with cli.py export <checkpoint> <folder>",
            signum,
        )

    def _pass_on(self, signum: int, frame) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action: die of the signal
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _install(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        for signum in PREEMPTION_SIGNALS:
            try:
                previous = signal.signal(signum, self._note)
            except ValueError:  # not the main thread (a notebook's worker): leave the defaults
                return
            self._previous.setdefault(signum, previous)  # the handlers from before the fit, not Lightning's

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError):
                signal.signal(signum, handler)
        self.stage = None

    # ---- stages ---------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.stage = LOADING
            self._install(trainer)

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)  # over Lightning's SIGTERM handler, registered after `setup`

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)
        if getattr(trainer, "received_sigterm", False):  # arrived between Lightning's handler and ours
            self.received = signal.SIGTERM
        self.stage = TRAINING
        self._step_seen = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._step_seen:  # an optimizer step just ended: a resumable point
            self._step_seen = trainer.global_step
            self._stop_if_asked(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self.stage == TRAINING:
            self._stop_if_asked(trainer)  # noted just before: stop before the validation starts
            self.stage = VALIDATING

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self.stage == VALIDATING:
            self.stage = TRAINING
            self._stop_if_asked(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stage = FINISHING

    def _stop_if_asked(self, trainer: pl.Trainer) -> None:
        flag = torch.tensor(float(self.received or 0), device=trainer.strategy.root_device)
        signum = int(trainer.strategy.reduce(flag, reduce_op="max"))
        if not signum:
            return
        name = signal_name(signum)
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        raise Preempted(
            f"fit stopped by {name} after global step {trainer.global_step}: a resumable checkpoint is at {path}; "
            f"continue with --ckpt_path {path} (nothing was exported)",
            signum,
        )

    def checkpoint_path(self, trainer: pl.Trainer) -> Path:
        return checkpoint_path(trainer, self.dirpath)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stage = None  # Lightning's own teardown may put our handler back: it then acts as the previous one
        if isinstance(exception, Interrupted) and exception.checkpoint is not None:
            _finish_validation_progress(trainer)
            trainer.save_checkpoint(exception.checkpoint, weights_only=False)
        self._restore()


def _finish_validation_progress(trainer: pl.Trainer) -> None:
    """Make the cut validation's progress counters those of a finished one (the batch in flight not counted), so
    the checkpoint is the one a save at ``on_validation_end`` writes: its resume continues training."""
    progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
    for tracker in (progress.total, progress.current):
        tracker.ready = tracker.started = tracker.processed = tracker.completed
