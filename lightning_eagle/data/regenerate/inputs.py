"""The input chat file: its rows read and validated up front, and which assistant turns of a row are regenerated."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_eagle.data.formats import TOO_DEEP, iter_rows
from lightning_eagle.data.regenerate.settings import RegenerateSettings
from lightning_eagle.data.render_k3 import ChatFormatError, build_k3_segments
from lightning_eagle.data.rows import DataRowError, RowProblem, validate_row


@dataclass(frozen=True)
class InputRow:
    """One valid chat row of the input, with where it came from (``file:line`` for messages)."""

    index: int  # 0-based position among the input's rows (the progress key)
    file: str
    line: int
    data: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def turns_to_regenerate(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of the assistant turns to replace: all but tool-calling ones and one with nothing before it."""
    return [i for i, m in enumerate(messages) if i > 0 and m.get("role") == "assistant" and not m.get("tool_calls")]


def read_input_rows(
    path: str | Path, settings: RegenerateSettings, on_bad_row: str = "raise"
) -> tuple[list[InputRow], list[str]]:
    """Read and validate every row (``file:line: field: problem`` errors). Returns the chat rows and, with
    ``on_bad_row="skip"``, the messages of the skipped ones. Pre-tokenized rows cannot be regenerated (bad)."""
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input chat file {str(path)!r} does not exist")
    rows: list[InputRow] = []
    bad: list[str] = []
    for index, raw in enumerate(iter_rows(path)):
        error = raw if isinstance(raw, DataRowError) else None
        if error is None:
            try:
                if validate_row(raw.data, 2**62) != "chat":
                    raise RowProblem("messages", "pre-tokenized rows cannot be regenerated (a 'messages' row needed)")
                # Render once now: problems only the template finds (tool names, options) fail here, not mid-run.
                build_k3_segments(raw.data["messages"], raw.data.get("tools"), **settings.render_options)
            except RowProblem as exc:
                error = DataRowError(raw.file, raw.line, exc.field, exc.problem)
            except ChatFormatError as exc:
                field_name, _, problem = str(exc).partition(": ")
                error = DataRowError(raw.file, raw.line, field_name, problem or str(exc))
            except RecursionError:
                error = DataRowError(raw.file, raw.line, "<json>", TOO_DEEP)
        if error is not None:
            if on_bad_row == "raise":
                raise DataRowError(error.file, error.line, error.field, error.problem, "--on-bad-row skip skips it")
            bad.append(str(error))
            continue
        rows.append(InputRow(index, raw.file, raw.line, raw.data))
    return rows, bad
