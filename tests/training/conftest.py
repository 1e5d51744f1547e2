"""Fixtures for the LightningModule / CLI tests (the tiny target, ``target_dir``, is the root conftest's)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
