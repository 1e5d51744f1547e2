"""The two progress files of a features folder that is written and read at once (a streaming fit):

* ``producer.json`` — written by ``cli.py extract``: its pid and host, a heartbeat (refreshed every few seconds), how
  many shards are done and its state (``running``, ``finished`` or ``failed`` with the error). A reader waiting for a
  shard tells from it whether to wait or stop.
* ``consumer.json`` — written by a streaming fit's rank 0: the training rows its **saved** checkpoints have passed
  (the rows a resumed fit will never read again). A producer asked to stay ahead by at most N shards waits on it, and
  shards entirely below it may be removed (``data.remove_consumed``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from lightning_eagle.features import format as fmt

PRODUCER_NAME, CONSUMER_NAME = fmt.PROGRESS_NAMES


def read_progress(path: Path) -> dict[str, Any] | None:
    """The file's content, or None when it is absent (or, being replaced atomically, momentarily unreadable)."""
    try:
        return fmt.read_json(path)
    except (OSError, ValueError):
        return None


class ProducerHeartbeat:
    """``producer.json`` of a running producer, refreshed every ``interval`` seconds by a daemon thread."""

    def __init__(self, folder: Path, num_shards: int, interval: float = 5.0) -> None:
        self.path, self.interval = folder / PRODUCER_NAME, interval
        self.state = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "state": "running",
                      "shards_done": 0, "num_shards": num_shards}  # fmt: skip
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._beat, name="producer-heartbeat", daemon=True)

    def __enter__(self) -> ProducerHeartbeat:
        self._write()
        self._thread.start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._stop.set()
        self._thread.join()
        if error is None:
            self.update(state="finished")
        else:  # a reader waiting for a shard stops at once, with the reason, instead of timing out
            self.update(state="failed", error=f"{kind.__name__}: {error}" if str(error) else kind.__name__)

    def update(self, **fields: Any) -> None:
        with self._lock:
            self.state.update(fields)
        self._write()

    def _write(self) -> None:
        with self._lock:
            state = {**self.state, "heartbeat": time.time()}
        fmt.write_json(self.path, state)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()


def producer_problem(folder: Path, timeout: float) -> str | None:
    """Why the producer of ``folder`` will not write another shard (failed, finished, or silent for ``timeout``
    seconds), or None while it is alive."""
    state = read_progress(folder / PRODUCER_NAME)
    if state is None:
        return None  # not started yet: the plan's presence is what a reader waits for
    where = f"the producer (pid {state.get('pid')} on {state.get('host')})"
    if state.get("state") == "failed":
        return f"{where} failed: {state.get('error')}"
    if state.get("state") == "finished":
        return f"{where} finished"
    silent = time.time() - float(state.get("heartbeat", 0))
    if silent > timeout:
        return f"{where} has not written a heartbeat for {silent:.0f} s (killed, or its machine is gone)"
    return None


def write_consumed(folder: Path, train_rows: int) -> None:
    fmt.write_json(folder / CONSUMER_NAME, {"consumed_train_rows": int(train_rows), "time": time.time()})


def consumed_rows(folder: Path) -> int:
    state = read_progress(folder / CONSUMER_NAME)
    return 0 if state is None else int(state.get("consumed_train_rows", 0))
