"""The regenerate loop: rows scheduled onto an engine, finished rows to the progress file, the output merged in
input order at the end; and the summary of a run."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_eagle.atomic import atomic_file
from lightning_eagle.data.dataset import file_sha256
from lightning_eagle.data.regenerate.engine import Engine, TurnJob, TurnResult
from lightning_eagle.data.regenerate.inputs import InputRow, read_input_rows, turns_to_regenerate
from lightning_eagle.data.regenerate.progress import PROGRESS_FORMAT, ProgressFile, progress_path
from lightning_eagle.data.regenerate.settings import RegenerateError, RegenerateSettings


@dataclass
class RegenerateSummary:
    """What one :func:`regenerate` call did (counts, tokens, time, errors); ``describe()`` is what the command
    prints."""

    rows_total: int = 0  # chat rows read (malformed ones excluded)
    rows_resumed: int = 0  # already in the progress file
    rows_generated: int = 0  # finished by this run
    rows_unchanged: int = 0  # no assistant turn to regenerate (copied)
    rows_bad_skipped: int = 0
    rows_failed: int = 0  # dropped after a failed turn (--on-failed-row drop)
    turns_generated: int = 0
    turns_truncated: int = 0  # ended by max_new_tokens
    turns_kept: int = 0  # assistant turns with tool calls, kept verbatim
    completion_tokens: int = 0
    seconds: float = 0.0
    complete: bool = False  # the output file was written
    output: str = ""
    errors: list[str] = field(default_factory=list)

    def describe(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        text = (
            f"{self.rows_total} rows: {self.rows_resumed} resumed, {self.rows_generated} generated now "
            f"({self.rows_unchanged} without a turn to regenerate), {self.rows_bad_skipped} malformed skipped, "
            f"{self.rows_failed} failed and dropped; {self.turns_generated} turns generated "
            f"({self.turns_truncated} cut by max_new_tokens, {self.turns_kept} tool-call turns kept), "
            f"{self.completion_tokens} tokens in {self.seconds:.1f}s ({rate:.1f} tokens/s)"
        )
        text += f"\nwrote {self.output}" if self.complete else "\nstopped before the end: run again to resume"
        if self.errors:
            text += "\nerrors:\n  " + "\n  ".join(self.errors[:20])
        return text


@dataclass
class _RowWork:
    row: InputRow
    messages: list[dict[str, Any]]
    pending: deque[int]  # turns not submitted yet (context="generated": one at a time)
    outstanding: int = 0
    failed: str | None = None


def regenerate(
    input_path: str | Path,
    output_path: str | Path,
    engine: Engine,
    *,
    on_bad_row: str = "raise",
    on_failed_row: str = "raise",
    overwrite: bool = False,
    stop_after_rows: int | None = None,
    log: Callable[[str], None] | None = None,
    log_interval: float = 10.0,
) -> RegenerateSummary:
    """Regenerate every assistant turn of ``input_path`` with ``engine`` (and its settings); write ``output_path``
    (JSONL, input order).

    Resumes from ``output_path``'s progress file when one exists (same input and settings), refuses to replace an
    existing output unless ``overwrite``. ``on_failed_row``: ``"raise"`` stops at the first turn that fails after
    its retries (the progress is kept: run again to continue), ``"drop"`` leaves that row out and goes on.
    ``stop_after_rows``: finish at most this many rows in this call, then return without writing the output (a
    partial run; the next call resumes). The engine is closed on return.
    """
    if on_failed_row not in ("raise", "drop"):
        raise ValueError(f"on_failed_row must be 'raise' or 'drop', got {on_failed_row!r}")
    start = time.perf_counter()
    settings = engine.settings
    input_path, output_path = Path(input_path), Path(output_path)
    summary = RegenerateSummary(output=str(output_path))
    try:
        if output_path.suffix == ".json":
            raise ValueError(f"{output_path}: the output is JSONL (one row per line); name it .jsonl")
        if output_path.resolve() == input_path.resolve():
            raise ValueError(f"{output_path}: the output must not be the input file")
        rows, bad = read_input_rows(input_path, settings, on_bad_row)
        summary.rows_total, summary.rows_bad_skipped = len(rows), len(bad)
        summary.errors += bad
        header = {
            "format": PROGRESS_FORMAT,
            "input_sha256": file_sha256(input_path),
            "settings": asdict(settings),
            "engine": engine.describe(),
        }
        progress = ProgressFile(progress_path(output_path), header)
        if overwrite:
            progress.path.unlink(missing_ok=True)
        elif output_path.exists() and not progress.path.exists():
            raise FileExistsError(f"{output_path} exists; pass --overwrite to regenerate it")
        progress.load()
        summary.rows_resumed = sum(1 for r in rows if r.index in progress.done)
        progress.open()
        try:
            finished = _Run(rows, engine, progress, summary, on_failed_row, stop_after_rows, log, log_interval)()
        finally:
            progress.close()
        if finished:
            with atomic_file(output_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                for r in rows:
                    if r.index in progress.done:
                        f.write(json.dumps(progress.done[r.index], ensure_ascii=False) + "\n")
            progress.path.unlink(missing_ok=True)
            summary.complete = True
    finally:
        engine.close()
    summary.seconds = time.perf_counter() - start
    return summary


class _Run:
    """The scheduling loop: rows start in input order while the engine has room; a row's turns run in sequence
    (``context="generated"``) or all at once (``"original"``); a finished row goes to the progress file."""

    def __init__(self, rows, engine, progress, summary, on_failed_row, stop_after_rows, log, log_interval) -> None:
        self.rows, self.engine, self.progress, self.summary = rows, engine, progress, summary
        self.settings: RegenerateSettings = engine.settings
        self.on_failed_row, self.stop_after_rows = on_failed_row, stop_after_rows
        self.log, self.log_interval = log, log_interval
        self.todo = deque(r for r in rows if r.index not in progress.done)
        self.work: dict[int, _RowWork] = {}
        self.in_flight = 0
        self.finished_now = 0
        self.start = time.perf_counter()

    def __call__(self) -> bool:
        """Run; True when every row was processed (False: stopped by ``stop_after_rows``)."""
        last_log = time.monotonic()
        while True:
            self._start_rows()
            if not self.work:
                return not self.todo
            results = self.engine.poll()
            if not results:
                raise RuntimeError(f"engine {self.engine.describe()} returned nothing with turns in flight")
            for job, result in results:
                self._on_result(job, result)
            if self.log is not None and time.monotonic() - last_log > self.log_interval:
                last_log = time.monotonic()
                self._log_progress()

    def _start_rows(self) -> None:
        limit = self.stop_after_rows
        while self.todo and self.in_flight < self.engine.capacity:
            if limit is not None and self.finished_now + len(self.work) >= limit:
                return
            r = self.todo.popleft()
            messages = [dict(m) for m in r.data["messages"]]
            w = _RowWork(r, messages, deque(turns_to_regenerate(messages)))
            self.summary.turns_kept += sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
            self.work[r.index] = w
            if not w.pending:
                self.summary.rows_unchanged += 1
                self._finish(w)
            elif self.settings.context == "generated":
                self._submit(w, w.pending.popleft())
            else:
                while w.pending:
                    self._submit(w, w.pending.popleft())

    def _submit(self, w: _RowWork, turn: int) -> None:
        source = w.messages if self.settings.context == "generated" else w.row.data["messages"]
        seed = self.settings.turn_seed(w.row.index, turn)
        self.engine.submit(TurnJob(w.row.index, turn, [dict(m) for m in source[:turn]], w.row.data.get("tools"), seed))
        w.outstanding += 1
        self.in_flight += 1

    def _on_result(self, job: TurnJob, result: TurnResult | BaseException) -> None:
        self.in_flight -= 1
        w = self.work[job.row]
        w.outstanding -= 1
        if isinstance(result, BaseException):
            message = f"{w.row.where}: messages[{job.turn}]: {result}"
            if self.on_failed_row == "raise":
                raise RegenerateError(
                    f"{message} (the rows done so far are kept in {self.progress.path}: run the same command again "
                    "to resume, or pass --on-failed-row drop to leave failing rows out)"
                ) from (result if isinstance(result, Exception) else None)
            w.failed = w.failed or message
            w.pending.clear()
        else:
            w.messages[job.turn] = result.message(w.row.data["messages"][job.turn], self.settings.thinking)
            self.summary.turns_generated += 1
            self.summary.turns_truncated += result.finish_reason == "length"
            self.summary.completion_tokens += result.completion_tokens
            if w.pending and w.failed is None:
                self._submit(w, w.pending.popleft())
        if w.outstanding == 0 and not w.pending:
            self._finish(w)

    def _finish(self, w: _RowWork) -> None:
        del self.work[w.row.index]
        self.finished_now += 1
        if w.failed is not None:
            self.summary.rows_failed += 1
            self.summary.errors.append(w.failed)
            self.progress.add_error(w.row.index, w.failed)
        else:
            self.progress.add(w.row.index, {**w.row.data, "messages": w.messages})
            self.summary.rows_generated += 1

    def _log_progress(self) -> None:
        done = len(self.progress.done) + self.summary.rows_failed
        rate = self.summary.completion_tokens / max(time.perf_counter() - self.start, 1e-9)
        self.log(f"regenerate: {done}/{len(self.rows)} rows, {self.summary.turns_generated} turns, {rate:.1f} tokens/s")
