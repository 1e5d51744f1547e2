"""A fit's output folders, claimed before any work: every one writable, and no second live run writing into them.

Two fits into one ``trainer.default_root_dir`` would replace each other's checkpoints and export without a word, and a
folder that cannot be written is otherwise found at the first save, after the training it was meant to keep. The
claim is an advisory ``flock`` on ``<root>/.lightning_eagle.lock``: the kernel drops it when its process ends, so a
run killed with ``kill -9`` never leaves the folder stuck. Only global rank 0 claims (the ranks of one run share it).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_eagle.atomic import check_writable
from lightning_eagle.errors import RunError

LOCK_NAME = ".lightning_eagle.lock"


class FolderInUseError(RunError):
    """Another live run holds the output folder."""


class FolderLock:
    """An exclusive, non-blocking claim on ``folder`` that the operating system releases when the holder exits."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip()
            os.close(fd)
            raise FolderInUseError(
                f"{self.path.parent} is in use by a live run ({describe_holder(holder)}): two runs into one folder "
                "would replace each other's checkpoints and export; wait for it to end or choose another "
                "trainer.default_root_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (removing it would race a new claimant)
            self._fd = None


def describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def output_folders(trainer: pl.Trainer) -> dict[str, Path]:
    """What a fit will write into, by the name a user knows it under."""
    folders = {"trainer.default_root_dir": Path(trainer.default_root_dir)}
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            folders[f"the checkpoint folder ({type(callback).__name__}.dirpath)"] = Path(callback.dirpath)
        resolved = getattr(callback, "resolved_out_dir", None)
        if callable(resolved):
            folders[f"the export folder's parent ({type(callback).__name__}.out_dir)"] = resolved(trainer).parent
    return folders


class RunFolderGuard(pl.Callback):
    """At the start of ``fit`` (before the target loads): every output folder writable, the run folder claimed."""

    def __init__(self) -> None:
        self._lock: FolderLock | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        for what, folder in output_folders(trainer).items():
            check_writable(folder, what)
        self._lock = FolderLock(trainer.default_root_dir)
        self._lock.acquire()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release()  # a failed fit in a notebook must not lock out the next one in the same process

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
