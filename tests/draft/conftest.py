"""Fixtures for the draft tests (builders in ``tests/draft_helpers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"


@pytest.fixture
def golden_draft_dir() -> Path:
    path = GOLDEN / "draft"
    if not path.is_dir():
        pytest.skip(f"golden files not found at {path} (the shared/golden folder next to the repo root)")
    return path
