"""Token-chunked target forward (``token_chunk``): every decoder layer walks the sequence in segments of ``C`` tokens,
layer-major (all segments of layer ℓ, then layer ℓ+1), so a layer's working set grows with ``C``, not with ``T``.

Exact by construction, ``token_chunk=None`` (the unchunked forward) being the twin:

* per-token parts (AttnRes mixes, norms, dense MLP, MoE routing and experts, projections) run per segment and write
  into one preallocated ``[B,T,H]`` output per layer;
* KDA continues its recurrent state ``S [B,h,K,V]`` and its short-conv tails (3 × ``[B,W−1,D]`` raw projections)
  from segment to segment: the continuation incremental decoding uses (``KimiDeltaAttention.forward`` with
  ``initial_state`` / ``conv_state`` / ``output_final_state``);
* MLA keeps this layer's keys and values for the tokens so far in ``[B,n,T,w]`` buffers (``w = max(d_qk, d_v)``,
  zero-padded columns, so the SDPA core never copies a padded ``v``); a segment's queries attend to keys
  ``[0, stop)`` with a ``[C, stop]`` causal ∧ key-not-padding mask, never ``[T,T]``. The buffers die with the layer.

Expert parallelism: every MoE layer is one collective exchange per segment, so every rank of the EP group must run
the same number of segments although ranks hold different ``T``. The ranks agree once per forward on the largest
``ceil(T/C)`` (the dispatcher's ``max_over_group``); a rank with fewer real segments runs empty ones, in which only
the MoE layers run (on 0 tokens) to keep the exchanges in step.

No autograd: the frozen target runs under ``torch.no_grad`` (buffers are written in place after being read). A
chunked forward with grad mode on and parameters that require grad is refused; with frozen parameters it runs under
``no_grad`` (its result could not require grad anyway).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from lightning_eagle.k3.kda import KimiDeltaAttention
from lightning_eagle.ops.mla import MLA_BACKEND, MLA_CORES, NoPEMLA, causal_allowed_mask
from lightning_eagle.settings import check_positive_int_or_none


def check_token_chunk(token_chunk: int | None) -> int | None:
    """``token_chunk``: tokens per segment (a positive int) or None (the unchunked forward)."""
    return check_positive_int_or_none("token_chunk", token_chunk, "tokens per segment", "unchunked")


@dataclass(frozen=True)
class TokenSegments:
    """The segments ``[start, stop)`` of one chunked forward over ``length`` tokens; segments past the end are
    empty (``start == stop == length``): they exist only so that every EP rank runs the same number."""

    length: int
    chunk: int
    count: int

    def __post_init__(self) -> None:
        if self.count < math.ceil(self.length / self.chunk):
            raise ValueError(f"{self.count} segments of {self.chunk} tokens cannot cover {self.length} tokens")

    @property
    def bounds(self) -> list[tuple[int, int]]:
        C, T = self.chunk, self.length
        return [(min(i * C, T), min((i + 1) * C, T)) for i in range(self.count)]


def agreed_segments(layers: Sequence[nn.Module], length: int, chunk: int, device: torch.device) -> TokenSegments:
    """This forward's segments: ``ceil(length / chunk)``, raised to the largest count of the EP group when the MoE
    layers dispatch across ranks (one collective here, once per forward; every MoE layer shares one dispatcher)."""
    count = math.ceil(length / chunk)
    for layer in layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            agree = getattr(moe.dispatch, "max_over_group", None)  # absent on the single-process dispatch
            if agree is not None:
                count = agree(count, device)
            break
    return TokenSegments(length, chunk, count)


def check_chunked_call(model: nn.Module, attention_mask: torch.Tensor | None, token_chunk: int) -> None:
    """Refusals of a chunked forward: autograd through it, and packed (indexed) masks."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
        raise RuntimeError(
            f"token_chunk={token_chunk} runs the frozen target without autograd, but grad mode is on and some target "
            "parameters require grad; call it under torch.no_grad() (or freeze the target), or set token_chunk=None"
        )
    if attention_mask is not None and bool(attention_mask.max() > 1):
        raise ValueError(
            f"token_chunk={token_chunk} needs a binary attention_mask (one document per row, 1 = token); got an "
            "indexed packing mask (values > 1); set token_chunk=None for packed rows"
        )


class KDASegments:
    """KDA over consecutive segments of one sequence: the recurrent state and conv tails carried between calls."""

    def __init__(self, attn: KimiDeltaAttention, token_mask: torch.Tensor | None) -> None:
        self.attn, self.token_mask = attn, token_mask
        self.state: torch.Tensor | None = None  # [B,h,K,V] fp32; None = zeros before the first segment
        self.tails: list[torch.Tensor] | None = None  # 3 × [B,W−1,D] fp32; None = zero left context

    def __call__(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        mask = None if self.token_mask is None else self.token_mask[:, start:stop]
        o, final = self.attn(x, mask, initial_state=self.state, conv_state=self.tails, output_final_state=True)
        self.state, self.tails = final.recurrent_state, final.conv_state
        return o


class MLASegments:
    """MLA over consecutive segments: keys/values of the tokens so far kept in ``[B,n,T,w]`` buffers (``w`` the
    wider of the qk and v head widths, the extra columns zero, as :func:`~lightning_eagle.ops.mla.sdpa_attention`
    pads them), each segment attending to the buffer prefix ``[0, stop)``."""

    def __init__(self, attn: NoPEMLA, length: int, token_mask: torch.Tensor | None) -> None:
        self.attn, self.length, self.token_mask = attn, length, token_mask
        self.width = max(attn.qk_head_dim, attn.v_head_dim)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        a, w = self.attn, self.width
        q, k, v = a.project(x)  # [B,n,C,d_qk] ×2, [B,n,C,d_v]
        B, n, C, _ = q.shape
        if self.keys is None:
            # Zeros, not empty: the padding columns must be zero (they add nothing to scores and outputs).
            self.keys = k.new_zeros(B, n, self.length, w)
            self.values = v.new_zeros(B, n, self.length, w)
        self.keys[:, :, start:stop, : k.shape[-1]] = k
        self.values[:, :, start:stop, : v.shape[-1]] = v
        q = q if q.shape[-1] == w else F.pad(q, (0, w - q.shape[-1]))
        keys, values = self.keys[:, :, :stop], self.values[:, :, :stop]
        backend = MLA_BACKEND.resolve(a.mla_backend, x.device)
        if self.token_mask is None and backend == "sdpa" and 0 < start and C > 1:
            # Causal with the diagonal aligned bottom-right, without a [C, stop] mask tensor: keeps the flash
            # kernels eligible (sdpa_attention would build a boolean mask for queries after a prefix).
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(C, stop), scale=a.scale)
        else:
            mask = None
            if self.token_mask is not None:
                mask = causal_allowed_mask(self.token_mask[:, :stop], C, x.device, past_length=start)  # [B,1,C,stop]
            o = MLA_CORES[backend](q, keys, values, mask, a.scale)
        o = o[..., : a.v_head_dim]
        return a.gate_output(o.transpose(1, 2).reshape(B, C, n * a.v_head_dim), x)


def segment_token_mixer(attn: nn.Module, length: int, token_mask: torch.Tensor | None):
    """The stateful ``(x, start, stop) -> out`` token mixer of one layer for one chunked forward."""
    if isinstance(attn, KimiDeltaAttention):
        return KDASegments(attn, token_mask)
    return MLASegments(attn, length, token_mask)
