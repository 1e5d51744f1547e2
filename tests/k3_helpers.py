"""Builders for tiny K3 models used across the target tests."""

from __future__ import annotations

import torch

from lightning_eagle.target import KimiK3ForCausalLM, config_from_name
from lightning_eagle.target.mxfp4 import decode_mxfp4, encode_mxfp4


def tiny_model(preset: str = "k3-tiny", seed: int = 0, kda_backend: str = "auto", **overrides) -> KimiK3ForCausalLM:
    model = KimiK3ForCausalLM(config_from_name(preset, **overrides), kda_backend=kda_backend).init_weights(seed)
    return model.freeze()


@torch.no_grad()
def snap_experts_to_mxfp4(model: KimiK3ForCausalLM) -> KimiK3ForCausalLM:
    """Round routed experts onto the MXFP4 grid so an MXFP4 checkpoint round trip is exact."""
    for module in model.modules():
        if type(module).__name__ == "RoutedExperts":
            for e in range(module.count):
                for w in (module.gate_up_proj[e], module.down_proj[e]):
                    w.copy_(decode_mxfp4(*encode_mxfp4(w.t())).t())
    return model
