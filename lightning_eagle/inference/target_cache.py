"""Per-layer decoding caches of the K3 target and the cached token mixers that use them.

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

from lightning_eagle.k3.kda import KimiDeltaAttention, roll_conv_state
from lightning_eagle.k3.kda_ops import kda_scale, naive_recurrent_kda

KDA_RECURRENCES = ("auto", "naive", "chunk")


@dataclass
class MLALayerCache:
    keys: torch.Tensor | None = None  # [B,n,L,d_qk]
    values: torch.Tensor | None = None  # [B,n,L,d_v]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys/values; returns all of them (the ``cache`` protocol of :meth:`NoPEMLA.forward`)."""
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
        _, self.state = naive_recurrent_kda(q, k, v, g, beta, scale, initial_state=ext.state, output_final_state=True)
        self.tails = [roll_conv_state(tail, raw[:, :keep]) for tail, raw in zip(ext.tails, ext.raws)]
        ext.inputs = tuple(t[:, :keep] for t in ext.inputs)
        ext.raws = [raw[:, :keep] for raw in ext.raws]


def kda_extend(
    attn: KimiDeltaAttention,
    x: torch.Tensor,
    cache: KDALayerCache,
    recurrence: str = "auto",
    rollbackable: bool = True,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """KDA over ``x [B,T,H]`` continuing from the cached conv tails and state (``token_mask``: False at left
    padding, prefills only). ``recurrence``: ``"naive"`` per token, ``"chunk"`` chunked, ``"auto"`` = chunked only for
    long inputs."""
    if recurrence not in KDA_RECURRENCES:
        raise ValueError(f"unknown KDA recurrence {recurrence!r}; choose one of {KDA_RECURRENCES}")
    B, T, _ = x.shape
    use_chunk = recurrence == "chunk" or (recurrence == "auto" and T > 4 * attn.chunk_size)
    W1, D = attn.q_conv1d.weight.shape[-1] - 1, attn.num_heads * attn.head_dim
    tails = cache.tails or [x.new_zeros(B, W1, D, dtype=torch.float32) for _ in range(3)]
    o, final = attn(
        x,
        token_mask,
        initial_state=cache.state,
        conv_state=tails,
        output_final_state=True,
        backend="chunk" if use_chunk else "naive",
    )
    cache.extension = (
        _KDAExtension(cache.state, tails, final.projections, final.recurrence_inputs) if rollbackable else None
    )
    cache.state, cache.tails = final.recurrent_state, final.conv_state
    return o
