"""Shared fixtures: the golden reference folder (vendored in ``tests/golden``, a byte copy of the public reference
outputs; never edited), the tiny K3 target checkpoint (``target_dir``, the one home of it) and tiny drafts."""

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


def pytest_collection_modifyitems(items):
    """A notebook trains a draft end to end: it belongs to the full lane (``-m "not slow"`` is the quick one)."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """The tests' tiny K3 target in the released layout (``k3-tiny`` sized for the synthetic tokenizer, vocab 512;
    unquantised experts), written once per session; a test that changes it copies it first."""
    from eagle_helpers import SYNTHETIC_IDS

    from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name
    from lightning_eagle.k3.writer import save_k3_checkpoint

    model = KimiK3ForCausalLM(config_from_name("k3-tiny", **SYNTHETIC_IDS)).init_weights(7)
    return save_k3_checkpoint(model, tmp_path_factory.mktemp("target") / "k3-tiny-512", mxfp4=False)


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
