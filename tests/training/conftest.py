"""Fixtures for the LightningModule / CLI tests: a small random K3 target in the released layout, sized for the
synthetic tokenizer (vocab 512)."""

from __future__ import annotations

import pytest
import torch
from eagle_helpers import SYNTHETIC_IDS

from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name
from lightning_eagle.k3.writer import save_k3_checkpoint


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    model = KimiK3ForCausalLM(config_from_name("k3-tiny", **SYNTHETIC_IDS)).init_weights(7)
    return save_k3_checkpoint(model, tmp_path_factory.mktemp("target") / "k3-tiny-512", mxfp4=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
