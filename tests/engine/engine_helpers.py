"""Constants and helpers shared by the engine fixtures and tests (a module of its own: ``conftest`` names collide
across test folders)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[2]
QUICKSTART_TARGET = REPO / "lightning_eagle" / "assets" / "k3-tiny-chat" / "model.safetensors"
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7, "mscale_all_dim": 1.0}
AUX_IDS = [4, 1, 3]  # not ascending (the export sorts them and permutes fc) and not vLLM's default (2, 3, 3)
K = 3  # num_speculative_tokens
PROMPTS = [[17, 300, 45, 101, 7, 260, 99, 3], [400, 12, 250, 5, 77]]
# vLLM 0.32's CPU C++ rotary kernel (RotaryEmbedding.forward_cpu, used in eager mode) mis-rotates the 3-D q/k its MLA
# layer passes: measured here, the tiny target's greedy output then differs from Hugging Face's DeepseekV3 and from
# itself with a draft attached, and a non-YaRN draft's forward is off. vLLM's reference rotary path (forward_native,
# also what torch.compile runs) is exact; the probes turn off that one custom op (a vLLM setting, not a patch).
REFERENCE_ROTARY = {"custom_ops": ["-rotary_embedding"]}


def target_embedding() -> torch.Tensor:
    with safe_open(str(QUICKSTART_TARGET), "pt") as f:
        return f.get_tensor("language_model.model.embed_tokens.weight").float()
