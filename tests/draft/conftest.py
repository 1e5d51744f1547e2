"""Fixtures for the draft tests (builders in ``tests/draft_helpers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def golden_draft_dir(golden_dir: Path) -> Path:
    return golden_dir / "draft"
