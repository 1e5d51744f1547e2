"""Shared fixtures: the golden reference folder (vendored in ``tests/golden``, a byte copy of the public reference
outputs; never edited) and tiny K3 models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    # A missing folder is a broken checkout, never a reason to skip: every clone tests what CI tests.
    assert GOLDEN_DIR.is_dir(), f"golden references missing at {GOLDEN_DIR} (they are committed with the repository)"
    return GOLDEN_DIR


@pytest.fixture
def make_config():
    """Builder of a k3-tiny draft config (``tests/draft_helpers.py``)."""
    from draft_helpers import tiny_config

    return tiny_config


@pytest.fixture
def make_draft():
    from draft_helpers import tiny_draft

    return tiny_draft


@pytest.fixture
def make_batch():
    from draft_helpers import tiny_batch

    return tiny_batch
