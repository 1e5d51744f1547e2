"""Reading a features folder while its producer (``cli.py extract``) is still writing it: a fit that trains as the
shards arrive (``HiddenStateDataModule(streaming=True)``).

* **Order**: the training rows are read shard by shard (shuffled within each shard), the order the producer writes
  them, so a batch never waits for a later shard while an earlier one is unfinished; the order depends only on the
  seed, the epoch and the plan's shard bounds, so a resumed fit continues exactly where the checkpoint left it.
* **Waiting**: a row whose shard is not written yet blocks with a visible reason; a producer that failed, finished
  without the shard or stopped its heartbeat for ``producer_timeout`` seconds stops the fit with the reason and the
  fix (:func:`~lightning_eagle.features.progress.producer_problem`).
* **Bounded disk**: the rows the saved checkpoints have passed are written to ``consumer.json`` (the producer's
  ``--max-ahead`` waits on it) and, with ``remove_consumed``, the shards entirely below them are deleted; their
  sidecars stay, marked removed, so neither a resumed producer nor a resumed fit asks for them again.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_eagle.features import format as fmt
from lightning_eagle.features import progress
from lightning_eagle.features.rows import FeatureRows

RESTART = (
    "restart `lightning-eagle extract` with the same options (it resumes where it stopped), then resume this fit from "
    "its last checkpoint (--ckpt_path …/last.ckpt)"
)


def wait_for_plan(folder: Path, timeout: float, poll: float = 1.0) -> dict[str, Any]:
    """``plan.json`` of a folder a producer is starting (or has finished: then its manifest)."""
    deadline, said = time.monotonic() + timeout, 0.0
    while True:
        for name in (fmt.MANIFEST_NAME, fmt.PLAN_NAME):
            if (folder / name).is_file():
                return fmt.read_json(folder / name)
        problem = progress.producer_problem(folder, timeout)
        if problem or time.monotonic() > deadline:
            raise RuntimeError(
                f"streaming features {folder}: no {fmt.PLAN_NAME} after {timeout:.0f} s"
                + (f" ({problem})" if problem else " (is `lightning-eagle extract --out` this folder?)")
            )
        if time.monotonic() - said > 30:
            print(f"waiting for {folder / fmt.PLAN_NAME}: the producer has not planned its shards yet", file=sys.stderr)
            said = time.monotonic()
        time.sleep(poll)


class StreamingFeatureRows(FeatureRows):
    """Rows of a folder still being written: a shard is opened only once complete (checked as ``verify`` says),
    after waiting for it."""

    def __init__(self, folder: Path, plan: dict[str, Any], start: int, stop: int, *, verify: str,
                 producer_timeout: float, poll: float = 1.0) -> None:  # fmt: skip
        super().__init__(folder, plan, start, stop)
        self.verify, self.producer_timeout, self.poll = verify, producer_timeout, poll

    @override
    def _layout(self, plan: dict[str, Any]) -> tuple[list[int], list[str]]:
        bounds = [int(b) for b in plan["shard_bounds"]]
        return bounds, [fmt.shard_name(k) for k in range(len(bounds) - 1)]

    @override
    def _open(self, k: int) -> None:
        self.wait_for_shard(k)
        super()._open(k)

    def wait_for_shard(self, k: int) -> None:
        name, rows = self.shards[k], self.bounds[k + 1] - self.bounds[k]
        said = time.monotonic()
        while True:
            info = progress.read_progress(self.folder / name.replace(".safetensors", ".json"))
            if info is not None and info.get("removed"):
                raise RuntimeError(
                    f"{self.folder / name} was removed after a fit trained past it (data.remove_consumed), and this "
                    "run reads it again: resume from the checkpoint that passed it, or extract again into a new folder"
                )
            if info is not None and info.get("rows") == rows and (self.folder / name).is_file():
                problem = fmt.shard_problem(self.folder / name, info, checksum=self.verify == "checksum")
                if problem:
                    raise ValueError(
                        f"{self.folder / name}: {problem}; remove it and its .json: the producer rewrites it"
                    )
                return
            problem = progress.producer_problem(self.folder, self.producer_timeout)
            if problem:
                raise RuntimeError(f"streaming features: {name} is not written and {problem}: {RESTART}")
            if time.monotonic() - said > 30:
                state = progress.read_progress(self.folder / progress.PRODUCER_NAME) or {}
                print(
                    f"waiting for {self.folder / name} (rows {self.bounds[k]}..{self.bounds[k + 1] - 1}): the producer "
                    f"has written {state.get('shards_done', 0)} of {len(self.shards)} shards",
                    file=sys.stderr,
                    flush=True,
                )
                said = time.monotonic()
            time.sleep(self.poll)


def train_segments(plan: dict[str, Any]) -> list[int]:
    """The training rows' shard boundaries (the order a streaming fit reads them in)."""
    train = int(plan["rows"]["train"])
    return sorted({0, train, *(b for b in plan["shard_bounds"] if b < train)})


def commit_consumed(folder: Path, plan: dict[str, Any], train_rows: int, remove: bool) -> list[str]:
    """Record that saved checkpoints passed the first ``train_rows`` training rows; with ``remove``, delete the
    shards entirely below them (their sidecars kept, marked removed). Returns the removed shards' names."""
    progress.write_consumed(folder, train_rows)
    if not remove:
        return []
    bounds, removed = [int(b) for b in plan["shard_bounds"]], []
    for k in range(len(bounds) - 1):
        if bounds[k + 1] > min(train_rows, int(plan["rows"]["train"])):
            break
        sidecar = folder / fmt.shard_name(k).replace(".safetensors", ".json")
        info = progress.read_progress(sidecar)
        if info is None or info.get("removed"):
            continue
        fmt.write_json(sidecar, {**info, "removed": f"trained past by a streaming fit at training row {train_rows}"})
        (folder / fmt.shard_name(k)).unlink(missing_ok=True)
        removed.append(fmt.shard_name(k))
    return removed
