"""Fixtures for the TTT training tests (builders in ``tests/draft_helpers.py``)."""

from __future__ import annotations

import pytest
from draft_helpers import tiny_batch, tiny_config, tiny_draft


@pytest.fixture
def make_config():
    return tiny_config


@pytest.fixture
def make_draft():
    return tiny_draft


@pytest.fixture
def make_batch():
    return tiny_batch
