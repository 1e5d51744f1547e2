"""The KDA recurrence continued from a carried state: what incremental target decoding needs.

:mod:`lightning_eagle.target.kda_ops` computes the recurrence from ``S_0 = 0`` and returns only the outputs (all a
training-time capture needs). Decoding extends a sequence piece by piece, so here both forms take an
``initial_state`` ``[B,H,K,V]`` (fp32; None = zeros) and also return the final state:

* :func:`naive_recurrent_kda_with_state` — one step per token, the readable twin (and the form used for the short
  extensions of a speculative-decoding round and for rollback replay);
* :func:`chunk_kda_with_state` — the chunked (WY) form for long prefills, identical maths.

Shapes and conventions are those of ``kda_ops``: ``q, k [B,T,H,K]`` (L2-normalised by the caller), ``v [B,T,H,V]``,
log-decay ``g [B,T,H,K]`` (≤ 0), ``beta [B,T,H]``; outputs fp32 ``[B,T,H,V]``.
"""

from __future__ import annotations

import torch

from lightning_eagle.target.kda_ops import flushed_exp, unit_lower_solve


def naive_recurrent_kda_with_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token recurrence from ``initial_state``; returns ``(o, S_T)``. With ``initial_state=None`` the outputs
    are op-for-op those of ``kda_ops.naive_recurrent_kda``."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float().clone()
    out = []
    for t in range(T):
        S = S * flushed_exp(g[:, t])[..., None]
        k_t = k[:, t]
        predicted = torch.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k_t, v[:, t] - predicted)
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
    o = torch.stack(out, dim=1) if out else q.new_zeros(B, 0, H, v.shape[-1])
    return o, S


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
    """Chunked form of :func:`naive_recurrent_kda_with_state` (the algorithm of ``kda_ops.chunk_kda``, whose state
    loop already carries ``S`` between chunks — here it starts from ``initial_state`` and ``S`` is returned).

    The zero tail padding (zero k, β and log-decay) leaves the state unchanged, so the returned state is the state
    after the last real token.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v, g = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C
    q, k, v, g = (t.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for t in (q, k, v, g))  # [B,H,N,C,·]
    beta = beta.reshape(B, N, C, H).permute(0, 3, 1, 2)
    G = g.cumsum(dim=-2)
    decay = G.exp()
    k_dec = k * decay
    k_inv = k * (-G).exp()
    q_dec = q * scale * decay
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = (k_dec @ k_inv.transpose(-1, -2)).masked_fill(~strict, 0.0)
    W = unit_lower_solve(beta[..., None] * A, torch.cat([beta[..., None] * v, beta[..., None] * k_dec], dim=-1))
    W_v, W_k = W[..., :V], W[..., V:]
    P = (q_dec @ k_inv.transpose(-1, -2)).masked_fill(~incl, 0.0)
    q_inter = q * scale * flushed_exp(G)
    chunk_decay = flushed_exp(G[..., -1, :])
    k_to_end = k * flushed_exp(G[..., -1:, :] - G)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    outs = []
    for n in range(N):
        U = W_v[:, :, n] - W_k[:, :, n] @ S
        outs.append(q_inter[:, :, n] @ S + P[:, :, n] @ U)
        S = chunk_decay[:, :, n, :, None] * S + k_to_end[:, :, n].transpose(-1, -2) @ U
    if not outs:
        return q.new_zeros(B, 0, H, V), S
    o = torch.stack(outs, dim=2)
    return o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T], S
