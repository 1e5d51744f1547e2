"""The progress file next to the output: what makes a killed run resumable without mixing outputs."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

PROGRESS_FORMAT = "lightning_eagle.regenerate_progress/1"


def progress_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".progress")


class ProgressFile:
    """Append-only JSONL: a header, then ``{"row": i, "data": {...}}`` per finished row (``{"row": i, "error": …}``
    for a dropped one; dropped rows are retried by the next run). A torn last line is cut off on open."""

    def __init__(self, path: Path, header: dict[str, Any], fsync_interval: float = 2.0) -> None:
        self.path, self.header, self.fsync_interval = path, header, fsync_interval
        self.done: dict[int, dict[str, Any]] = {}
        self.torn = 0
        self._file = None
        self._last_sync = time.monotonic()

    def load(self) -> bool:
        """Read an existing file; True when it was resumed. Raises when it belongs to another input/settings."""
        if not self.path.exists():
            return False
        raw = self.path.read_bytes()
        end = raw.rfind(b"\n") + 1
        if end < len(raw):  # killed in the middle of a line: that row is simply generated again
            self.torn += 1
            with open(self.path, "r+b") as f:
                f.truncate(end)
        lines = raw[:end].decode("utf-8", "replace").splitlines()
        try:
            header = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("format") != PROGRESS_FORMAT:
            if len(lines) > 1:
                raise ValueError(f"{self.path}: not a regenerate progress file; delete it or pass --overwrite")
            self.path.unlink()  # a header torn at the very start: nothing was done
            return False
        entries = []
        for line in lines[1:]:
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                self.torn += 1
        done = [e for e in entries if isinstance(e, dict) and isinstance(e.get("row"), int)
                and isinstance(e.get("data"), dict)]  # fmt: skip
        mine, theirs = self.header, header
        if {k: theirs.get(k) for k in mine} != mine:
            if not done:  # no finished row (e.g. a run whose every request failed on a wrong --model): nothing to keep
                self.path.unlink()
                self.torn = 0
                return False
            diff = sorted(k for k in mine if theirs.get(k) != mine[k])
            raise ValueError(
                f"{self.path} was written by a run with other {', '.join(diff)} (resuming would mix outputs): "
                "rerun with the same input and settings, or pass --overwrite to start over"
            )
        for entry in done:
            self.done.setdefault(entry["row"], entry["data"])  # first wins: never two copies of a row
        return True

    def open(self) -> None:
        new = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if new:
            self._write(self.header, sync=True)

    def _write(self, entry: dict[str, Any], sync: bool = False) -> None:
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()  # in the OS after every row: a killed process loses nothing it reported done
        if sync or time.monotonic() - self._last_sync > self.fsync_interval:
            os.fsync(self._file.fileno())
            self._last_sync = time.monotonic()

    def add(self, row: int, data: dict[str, Any]) -> None:
        if row not in self.done:
            self.done[row] = data
            self._write({"row": row, "data": data})

    def add_error(self, row: int, error: str) -> None:
        self._write({"row": row, "error": error})

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
