"""Callbacks the streaming kill/resume test puts into a ``cli.py fit`` config (this folder on ``PYTHONPATH``)."""

from __future__ import annotations

import json
import os
import signal

import lightning.pytorch as pl


class RecordRows(pl.Callback):
    """Appends ``{"step": global step, "rows": [each row's tokens]}`` to ``path`` as each training batch starts."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "rows": rows}) + "\n")


class KillAt(pl.Callback):
    """SIGKILLs this process as the batch of ``step`` starts (a killed job: no teardown, nothing saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
