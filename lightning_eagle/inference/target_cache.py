"""Per-layer decoding caches of the K3 target and the token mixers that continue from them.

Only K3's token mixers carry information across positions; embeddings, AttnRes mixing, norms, MLP/MoE and the head are
per-token. So the cache of the whole target is one entry per layer:

* **MLA** layers keep the per-head keys ``[B,n,L,d_qk]`` and values ``[B,n,L,d_v]`` that :meth:`NoPEMLA.project`
  produced. This is the exact form (the same tensors a full forward would build). The memory-lean alternative is the
  576-wide latent ``[lat | k_rot]`` per token, at the price of re-running ``kv_b_proj`` over the prefix every step or
  of the absorbed-matmul form (different rounding); left as an extension.
* **KDA** layers keep the recurrent state ``S [B,h,K,V]`` (fp32) and the short-conv tail: the last ``W−1`` *raw*
  (pre-conv) q/k/v projections ``[B,W−1,D]`` (zeros before the first token = the full forward's left padding).

Rollback (to an accepted prefix) — the choice: **replay from a snapshot**. An extension made with ``rollbackable``
keeps the KDA state and conv tails from *before* it plus the recurrence inputs (q, k, v, g, β) and raw projections of
its own tokens. Rolling back to ``keep`` of its tokens re-runs the per-token recurrence for those ``keep`` tokens from
the snapshot (op for op what a per-token extension computed, so the state is bit-identical to the one it passed
through at that position) and rebuilds the conv tail from the raw projections. MLA keys/values are simply
truncated. Why not keep a state per position: at K3 scale one KDA state is 96·128·128·4 B = 6.3 MB per layer, i.e.
0.43 GB per position over 69 layers — per-position states for an 8-token verification would cost 3.5 GB per
sequence, while the snapshot costs one state and the replay ≤ K+1 cheap recurrence steps per layer (the projections
are not recomputed). Rolling back further than the start of the last
extension is refused: that state is gone. Prefills are made non-rollbackable (their recurrence inputs would be
``O(T·D)`` per layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lightning_eagle.inference.kda_state import chunk_kda_with_state, naive_recurrent_kda_with_state
from lightning_eagle.ops.mla import NoPEMLA
from lightning_eagle.target.kda import KimiDeltaAttention, causal_depthwise_conv, l2_normalize
from lightning_eagle.target.kda_ops import kda_scale

KDA_RECURRENCES = ("auto", "naive", "chunk")


@dataclass
class MLALayerCache:
    keys: torch.Tensor | None = None  # [B,n,L,d_qk]
    values: torch.Tensor | None = None  # [B,n,L,d_v]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


@dataclass
class _KDAExtension:
    """What a rollbackable extension needs to be undone or shortened."""

    state: torch.Tensor | None  # S before the extension (None = zeros)
    tails: list[torch.Tensor]  # conv tails before the extension
    raws: list[torch.Tensor]  # raw q/k/v projections of the extension's tokens [B,T,D]
    inputs: tuple[torch.Tensor, ...]  # (q, k, v, g, beta) of the extension's tokens


@dataclass
class KDALayerCache:
    state: torch.Tensor | None = None  # [B,h,K,V] fp32; None = zeros (nothing seen yet)
    tails: list[torch.Tensor] | None = None  # 3 × [B,W-1,D] fp32 raw projections (q, k, v)
    extension: _KDAExtension | None = field(default=None, repr=False)

    def truncate_extension(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of the last extension (replays the recurrence from its snapshot)."""
        ext = self.extension
        if ext is None:
            raise RuntimeError("no rollbackable KDA extension to shorten")
        q, k, v, g, beta = (t[:, :keep] for t in ext.inputs)
        scale = kda_scale(q.shape[-1])
        _, self.state = naive_recurrent_kda_with_state(q, k, v, g, beta, scale, ext.state)
        W1 = ext.tails[0].shape[1]
        self.tails = [
            torch.cat([tail, raw[:, :keep]], dim=1)[:, -W1:] if W1 else tail for tail, raw in zip(ext.tails, ext.raws)
        ]
        ext.inputs = tuple(t[:, :keep] for t in ext.inputs)
        ext.raws = [raw[:, :keep] for raw in ext.raws]


def mla_extend(attn: NoPEMLA, x: torch.Tensor, cache: MLALayerCache) -> torch.Tensor:
    """MLA over ``x [B,T,H]`` (the normalised layer input of T new tokens) attending to the cached prefix plus
    themselves, causally; the same ops as :meth:`NoPEMLA.forward` with keys offset by the cached length."""
    q, k, v = attn.project(x)
    keys, values = cache.append(k, v)
    B, n, T, _ = q.shape
    L = keys.shape[2]
    scores = torch.matmul(q, keys.transpose(-1, -2)) * attn.scale
    # New token i stands at absolute position L−T+i and may see keys 0..L−T+i.
    allowed = torch.arange(L, device=x.device)[None, :] <= torch.arange(L - T, L, device=x.device)[:, None]
    mask = torch.zeros(T, L, dtype=scores.dtype, device=x.device).masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float() + mask.float(), dim=-1).to(values.dtype)
    o = torch.matmul(probs, values).transpose(1, 2).reshape(B, T, n * attn.v_head_dim)
    return attn.gate_output(o, x)


def kda_extend(
    attn: KimiDeltaAttention,
    x: torch.Tensor,
    cache: KDALayerCache,
    recurrence: str = "auto",
    rollbackable: bool = True,
) -> torch.Tensor:
    """KDA over ``x [B,T,H]`` continuing from the cached conv tails and state (the maths of
    :meth:`KimiDeltaAttention.forward` for an unpadded single-document row, reusing its projections, decay and norm
    helpers). ``recurrence``: ``"naive"`` per token, ``"chunk"`` chunked, ``"auto"`` = chunked only for long inputs."""
    B, T, _ = x.shape
    n, d = attn.num_heads, attn.head_dim
    W1 = attn.q_conv1d.weight.shape[-1] - 1
    D = n * d
    tails = cache.tails or [x.new_zeros(B, W1, D, dtype=torch.float32) for _ in range(3)]
    raws, streams, new_tails = [], [], []
    for tail, proj, conv in zip(
        tails, (attn.q_proj, attn.k_proj, attn.v_proj), (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)
    ):
        raw = proj(x).float()
        full = torch.cat([tail, raw], dim=1)  # the tail plays the role of the full forward's earlier tokens
        streams.append(F.silu(causal_depthwise_conv(full, conv.weight.float(), None)[:, W1:]))
        raws.append(raw)
        new_tails.append(full[:, full.shape[1] - W1 :])
    q, k, v = (s.view(B, T, n, d) for s in streams)
    q, k = l2_normalize(q), l2_normalize(k)
    g = attn.decay(x)
    beta = torch.sigmoid(attn.b_proj(x).float())
    if recurrence not in KDA_RECURRENCES:
        raise ValueError(f"unknown KDA recurrence {recurrence!r}; choose one of {KDA_RECURRENCES}")
    use_chunk = recurrence == "chunk" or (recurrence == "auto" and T > 4 * attn.chunk_size)
    if use_chunk:
        o, state = chunk_kda_with_state(q, k, v, g, beta, kda_scale(d), attn.chunk_size, cache.state)
    else:
        o, state = naive_recurrent_kda_with_state(q, k, v, g, beta, kda_scale(d), cache.state)
    cache.extension = _KDAExtension(cache.state, tails, raws, (q, k, v, g, beta)) if rollbackable else None
    cache.state, cache.tails = state, new_tails
    # Gated per-head output norm and projection, as in KimiDeltaAttention.forward.
    o32 = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + attn.o_norm_eps) * attn.o_norm.weight.float()
    gate = torch.sigmoid(attn.g_proj(x).float().view(B, T, n, d))
    return attn.o_proj((o32 * gate).to(x.dtype).reshape(B, T, D))
