"""The KDA (Kimi Delta Attention) recurrence: a readable per-token twin and a chunked plain-torch form.

Shapes follow flash-linear-attention: ``q, k [B,T,H,K]``, ``v [B,T,H,V]``, log-decay ``g [B,T,H,K]`` (≤ 0),
``beta [B,T,H]``. Per (row, head) with fp32 state ``S ∈ R^{K×V}``, ``S_0 = 0``::

    S̃_t = Diag(exp(g_t)) S_{t-1}
    S_t = S̃_t + β_t k_t (v_t − S̃_tᵀ k_t)ᵀ
    o_t = S_tᵀ (q_t · scale)

Both functions compute in fp32 and return fp32 ``[B,T,H,V]``. Callers normalise q/k (L2) beforehand.
"""

from __future__ import annotations

import math

import torch


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """One step per token. The reference for every other KDA path (slow: T sequential steps).

    ``initial_state [B,H,K,V]`` continues a sequence (incremental decoding); ``output_final_state`` also returns
    ``S_T``.
    """
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
    return (o, S) if output_final_state else o


def safe_chunk_size(gate_lower_bound: float, max_chunk: int = 64) -> int:
    """Largest power-of-two chunk whose worst in-chunk decay ``exp(-|lb|·C)`` stays representable in fp32.

    The chunked form factorises ``exp(G_s − G_r)`` as ``exp(G_s)·exp(−G_r)``; with G ≥ lb·C per chunk both factors
    must stay inside fp32's normal range (|exponent| ≤ 80 keeps a margin below 88).
    """
    chunk = max_chunk
    while chunk > 1 and chunk * abs(gate_lower_bound) > 80:
        chunk //= 2
    return chunk


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk_size: int = 16,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """Chunked (WY) form of :func:`naive_recurrent_kda`; identical maths, ``T / chunk_size`` sequential steps.

    Inside a chunk with in-chunk cumulative log-decay ``G_t`` (so ``Γ_t = exp(G_t)``), the delta-rule pseudo values
    ``U`` solve the unit lower-triangular system ``(I + diag(β)·StrictLower(K̃ K̂ᵀ)) U = diag(β)(V − K̃ S_0)`` with
    ``K̃ = K⊙Γ`` and ``K̂ = K⊙Γ⁻¹``; then ``O = Q̃ S_0 + LowerIncl(Q̃ K̂ᵀ) U`` and
    ``S_C = Γ_C ⊙ S_0 + (K⊙Γ_C/Γ)ᵀ U``. Everything independent of ``S_0`` is computed for all chunks at once.
    ``chunk_size`` must satisfy ``chunk_size·max|g| ≤ ~80`` (see :func:`safe_chunk_size`). ``initial_state`` /
    ``output_final_state`` as in :func:`naive_recurrent_kda` (the zero tail padding leaves the state unchanged).
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    if pad:
        # Zero k/v/β and zero decay in the tail keep the state unchanged there; the tail outputs are dropped.
        q, k, v, g = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C
    # [B,H,N,C,·]
    q, k, v, g = (t.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for t in (q, k, v, g))
    beta = beta.reshape(B, N, C, H).permute(0, 3, 1, 2)
    G = g.cumsum(dim=-2)
    decay = G.exp()
    k_dec = k * decay  # K̃
    k_inv = k * (-G).exp()  # K̂
    q_dec = q * scale * decay  # Q̃ (intra-chunk factor)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = (k_dec @ k_inv.transpose(-1, -2)).masked_fill(~strict, 0.0)
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * k_dec], dim=-1)
    W = unit_lower_solve(beta[..., None] * A, rhs)
    W_v, W_k = W[..., :V], W[..., V:]
    P = (q_dec @ k_inv.transpose(-1, -2)).masked_fill(~incl, 0.0)
    # Terms that multiply the carried state use decays flushed to 0 below e^-60: the true contribution is < 1e-26
    # of the state, and letting it go subnormal makes CPU float maths 10-100x slower on trained gates.
    q_inter = q * scale * flushed_exp(G)
    chunk_decay = flushed_exp(G[..., -1, :])  # Γ_C  [B,H,N,K]
    k_to_end = k * flushed_exp(G[..., -1:, :] - G)  # K⊙Γ_C/Γ
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    outs = []
    for n in range(N):
        U = W_v[:, :, n] - W_k[:, :, n] @ S
        outs.append(q_inter[:, :, n] @ S + P[:, :, n] @ U)
        S = chunk_decay[:, :, n, :, None] * S + k_to_end[:, :, n].transpose(-1, -2) @ U
    if not outs:
        o = q.new_zeros(B, 0, H, V)
    else:
        o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]  # from [B,H,N,C,V]
    return (o, S) if output_final_state else o


def flushed_exp(x: torch.Tensor, floor: float = -60.0) -> torch.Tensor:
    """``exp(x)`` with results below ``e^floor`` set to exactly 0 (keeps the recurrence out of subnormal floats)."""
    return x.exp().masked_fill(x < floor, 0.0)


def unit_lower_solve(L: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve ``(I + L) X = rhs`` for strictly lower-triangular ``L [..., C, C]`` by forward substitution.

    A row loop over the (small) chunk instead of ``torch.linalg.solve_triangular``: batched LAPACK calls on
    thousands of 16×16 systems are orders of magnitude slower on CPU.
    """
    rows = [rhs[..., 0, :]]
    for i in range(1, L.shape[-1]):
        done = torch.stack(rows, dim=-2)  # [..., i, ·]
        rows.append(rhs[..., i, :] - (L[..., i, :i, None] * done).sum(-2))
    return torch.stack(rows, dim=-2)


def fla_kda_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True


def fla_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    kernel: str = "fused_recurrent",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """flash-linear-attention's Triton KDA (CUDA only). q/k are already L2-normalised by the caller.
    ``initial_state`` / ``output_final_state`` as in :func:`naive_recurrent_kda` (fla's own argument names).

    ``fused_recurrent`` is the default because it is the kernel the golden reference was checked with; fla 0.6.0's
    ``chunk`` kernel disagreed with the golden on a full tiny model (spec §10). Neither is used by ``backend="auto"``
    until :mod:`lightning_eagle.k3.kda_records` holds a whole-model pass for it on the device class.
    """
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda

    fn = fused_recurrent_kda if kernel == "fused_recurrent" else fla_chunk_kda
    o, S = fn(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state
    )
    return (o.float(), S.float()) if output_final_state else o.float()


def kda_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
