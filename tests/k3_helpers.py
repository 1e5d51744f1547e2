"""Builders for tiny K3 models used across the target tests."""

from __future__ import annotations

from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name
from lightning_eagle.k3.writer import snap_experts_to_mxfp4  # noqa: F401  (re-exported for tests)


def tiny_model(preset: str = "k3-tiny", seed: int = 0, kda_backend: str = "auto", **overrides) -> KimiK3ForCausalLM:
    model = KimiK3ForCausalLM(config_from_name(preset, **overrides), kda_backend=kda_backend).init_weights(seed)
    return model.freeze()
