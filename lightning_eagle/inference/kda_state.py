"""The KDA recurrence continued from a carried state: what incremental target decoding needs.

:mod:`lightning_eagle.target.kda_ops` owns the maths; decoding extends a sequence piece by piece, so these names
call it with an ``initial_state`` ``[B,H,K,V]`` (fp32; None = zeros) and return the final state too:

* :func:`naive_recurrent_kda_with_state` — one step per token, the readable twin (and the form used for the short
  extensions of a speculative-decoding round and for rollback replay);
* :func:`chunk_kda_with_state` — the chunked (WY) form for long prefills, identical maths.

Shapes and conventions are those of ``kda_ops``: ``q, k [B,T,H,K]`` (L2-normalised by the caller), ``v [B,T,H,V]``,
log-decay ``g [B,T,H,K]`` (≤ 0), ``beta [B,T,H]``; outputs fp32 ``[B,T,H,V]``.
"""

from __future__ import annotations

import torch

from lightning_eagle.target.kda_ops import chunk_kda, naive_recurrent_kda


def naive_recurrent_kda_with_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token recurrence from ``initial_state``; returns ``(o, S_T)``."""
    return naive_recurrent_kda(q, k, v, g, beta, scale, initial_state=initial_state, return_final_state=True)


def chunk_kda_with_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk_size: int = 16,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of :func:`naive_recurrent_kda_with_state`; returns ``(o, S_T)`` (state after the last token)."""
    return chunk_kda(q, k, v, g, beta, scale, chunk_size, initial_state=initial_state, return_final_state=True)
