"""The serving engine's file contract computed by our own K3 target: the readable twin of a vLLM engine for the
producer (``cli.py extract``), used where vLLM cannot run K3 (its CPU build) to test the producer, to measure its
overhead against ``cli.py dump`` on the same forward, and as the reference a GPU vLLM's files are checked against.

vLLM's ``extract_hidden_states`` numbering on K3 (``engine_features.md``): id k (0 < k < L) is the output of layer
k − 1 on the stream ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM`` selects (0: our ``prefix``, 1: ``mixed``); id L under stream 1
is the pre-norm output, under stream 0 (vLLM 0.32) the open AttnRes block's partial sum, i.e. our ``prefix`` tap of
layer L − 1. Id 0 (the embeddings) is not offered: no draft taps it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

from lightning_eagle.features.engine_client import FeatureEngine
from lightning_eagle.features.engine_ids import STREAM_ENV, STREAM_ENV_VALUES
from lightning_eagle.k3.capture import capture_taps


def engine_columns(model, input_ids: torch.Tensor, ids: list[int], stream: str) -> torch.Tensor:
    """``[B, T, len(ids), H]``: what vLLM's file holds for ``ids`` (ascending) on ``stream``, from our ``model``."""
    L = model.config.num_hidden_layers
    if not ids or ids != sorted(set(ids)) or ids[0] < 1 or ids[-1] > L:
        raise ValueError(f"engine ids must be ascending, unique and within 1..{L}, got {ids}")
    taps = [i - 1 for i in ids]  # id L is layer L - 1's output on the stream, except stream 1's pre-norm output
    cap = capture_taps(model, input_ids, None, tuple(taps), stream, False, True)
    B, T = input_ids.shape
    columns = cap.aux_hidden_states.reshape(B, T, len(taps), -1)
    if stream == "mixed" and ids[-1] == L:  # equal to layer L - 1's mixed tap; taken as the model computes it
        columns = torch.cat([columns[:, :, :-1], cap.final_prenorm[:, :, None]], dim=2)
    return columns


class OwnTargetEngine(FeatureEngine):
    """A :class:`FeatureEngine` writing vLLM's files (``{storage}/req-{n}.safetensors``: ``hidden_states [T, n_ids,
    H]``, ``token_ids [T]``) from our ``model`` on ``stream``; it reports the stream setting vLLM would run with."""

    def __init__(self, model, ids, storage: Path, stream: str = "mixed", version: str = "own-target") -> None:
        self.model, self.ids, self.stream = model, list(ids), stream
        self.storage, self.version, self.where = Path(storage), version, "our own K3 target (the engine's twin)"
        self.storage.mkdir(parents=True, exist_ok=True)
        self.env = {STREAM_ENV: STREAM_ENV_VALUES[stream]}
        self.count, self.lock = 0, threading.Lock()

    def write(self, prompt: list[int]) -> Path:
        device = next(self.model.parameters()).device
        with self.lock, torch.no_grad():  # one forward at a time: a server's threads share the model
            states = engine_columns(self.model, torch.tensor([prompt], device=device), self.ids, self.stream)
            path = self.storage / f"req-{self.count}.safetensors"
            self.count += 1
        save_file({"hidden_states": states[0].cpu().contiguous(), "token_ids": torch.tensor(prompt)}, str(path))
        return path

    def capture(self, prompts: list[list[int]]) -> list[Path]:
        return [self.write(p) for p in prompts]
