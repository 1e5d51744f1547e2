"""Plain (target-only) autoregressive decoding with the incremental target: the baseline of speculative decoding.

One target forward per token. At temperature 0 this is the greedy output that speculative decoding must reproduce
token for token; its wall time is the denominator of the speed-up in the acceptance report.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from lightning_eagle.inference.incremental_target import (
    DEFAULT_PREFILL_CHUNK,
    check_prefill_chunk,
    chunk_bounds,
)
from lightning_eagle.inference.sampling import check_top_p, pick_token
from lightning_eagle.inference.speculative import open_session


@dataclass
class PlainOutput:
    tokens: list[int]  # new tokens only
    target_forwards: int
    seconds: float
    stopped: bool = False


@torch.no_grad()
def plain_generate(
    target,
    prompt_ids,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    *,
    stop_token_ids: Iterable[int] | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    top_p: float = 1.0,
) -> PlainOutput:
    """Decode ``max_new_tokens`` tokens with the target alone (stop tokens end it, and are kept). ``prefill_chunk``:
    prompt tokens per prefill forward (None = one forward), as in
    :func:`~lightning_eagle.inference.speculative_generate`; ``top_p``: sample the top-p nucleus (temperature > 0)."""
    check_prefill_chunk(prefill_chunk)
    check_top_p(top_p)
    start = time.perf_counter()
    session, prompt, gen, stop = open_session(target, prompt_ids, seed, stop_token_ids)
    tokens: list[int] = []
    forwards = 0
    if max_new_tokens > 0:
        T = prompt.shape[1]
        for begin, end in chunk_bounds(T, prefill_chunk):
            step = session.prefill_chunk(prompt[:, begin:end], begin, return_logits="last" if end == T else False)
        forwards = 1  # the prefill counts once, whatever its number of chunks
        while True:
            tokens.append(pick_token(step.logits[0, -1], temperature, gen, top_p))
            if len(tokens) >= max_new_tokens or tokens[-1] in stop:
                break
            step = session.extend(prompt.new_tensor([[tokens[-1]]]), return_logits="last", rollbackable=False)
            forwards += 1
    return PlainOutput(tokens, forwards, time.perf_counter() - start, stopped=bool(tokens) and tokens[-1] in stop)
