"""Used by the kill -9 and preemption tests inside their ``cli.py fit`` subprocesses (``tests/`` is on their
``PYTHONPATH``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning.pytorch import Callback

from lightning_eagle.checkpoint_io import AtomicCheckpointIO


class StallingCheckpointIO(AtomicCheckpointIO):
    """Stalls the save whose file name contains ``$STALL_AT`` after its bytes are written but before it takes its
    final name, and announces it by creating ``$STALL_MARKER``: the test kills the process right then."""

    def before_publish(self, tmp: Path, final: Path) -> None:
        if os.environ.get("STALL_AT", "\0") in final.name:
            Path(os.environ["STALL_MARKER"]).write_text(str(tmp))
            time.sleep(120)


class SignalAtStep(Callback):
    """Sends this process a real ``signum`` when batch ``at_batch`` starts (a scheduler's preemption, on cue)."""

    def __init__(self, at_batch: int, signum: int = 15) -> None:
        self.at_batch, self.signum = at_batch, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at_batch:
            os.kill(os.getpid(), self.signum)
