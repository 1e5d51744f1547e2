"""What every bad-input table shares (``tests/test_bad_inputs*.py``): the good row, the checks of a refusal (one
clear error raised by this library, its message's fragments in order) and of nothing written (a folder snapshot)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from string import Template

import pytest

import lightning_eagle

LIBRARY = Path(lightning_eagle.__file__).resolve().parent
GOOD = {"messages": [{"role": "user", "content": "hi, how are you?"}, {"role": "assistant", "content": "fine, thanks"}]}
SKIP_HINT = "set on_bad_row='skip' (CLI: --data.on_bad_row skip)"


# ---- shared checks ---------------------------------------------------------------------------------------------------
def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (hidden ``.partial`` leftovers included) → content hash, or ``"dir"``."""
    return {
        str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def fill(fragments: list[str], **paths) -> list[str]:
    return [Template(f).safe_substitute({k: str(v) for k, v in paths.items()}) for f in fragments]


def pattern(fragments: list[str]) -> str:
    """The fragments, in order, anywhere in the message (``pytest.raises(match=...)`` searches)."""
    return "(?s)" + ".*".join(re.escape(f) for f in fragments)


def assert_raised_by_library(info: pytest.ExceptionInfo) -> None:
    """Not a traceback from deep inside a dependency: the innermost frame is this library's code."""
    where = Path(str(info.traceback[-1].path)).resolve()
    assert LIBRARY in where.parents, f"{info.typename} raised at {where}:{info.traceback[-1].lineno + 1}"


def expect(exc: type[BaseException], fragments: list[str], **paths):
    return pytest.raises(exc, match=pattern(fill(fragments, **paths)))
