"""KDA token mixer (69 of K3's 93 layers): projections, causal short conv + SiLU, bounded per-channel decay,
β, L2-normalised q/k, the delta-rule recurrence and a gated per-head output norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_eagle.backends import BackendRegistry, BackendSetting
from lightning_eagle.k3 import kda_records
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.kda_ops import (
    chunk_kda,
    fla_kda,
    fla_kda_available,
    kda_scale,
    naive_recurrent_kda,
    safe_chunk_size,
)

AUTO_FLA_PREFERENCE = ("fla_chunk", "fla")  # among checked fla kernels, chunk first: the target runs long prefills


def auto_kda_backend(device: torch.device) -> str:
    """The first fla kernel of :data:`AUTO_FLA_PREFERENCE` that is installed *and* has passed the whole-model check on
    this device class (:mod:`lightning_eagle.k3.kda_records`), else the plain-torch ``chunk`` path. fla is never
    picked on trust alone (`k3_target.md` §10); ``fla`` / ``fla_chunk`` remain explicit opt-ins."""
    if fla_kda_available(device):
        passed = kda_records.passed_kda_backends(device)
        for name in AUTO_FLA_PREFERENCE:
            if name in passed:
                return name
    return "chunk"


KDA_BACKEND = BackendRegistry(
    setting="kda_backend",
    what="KDA backend",
    names={
        "chunk": "chunked WY form in plain torch: any device, the auto choice until an fla kernel passed the check",
        "naive": "one step per token: the reference twin",
        "fla": "flash-linear-attention fused_recurrent (CUDA)",
        "fla_chunk": "flash-linear-attention chunk (CUDA; fla 0.6.0's disagreed with the golden on an H200)",
    },
    auto=auto_kda_backend,
)


def resolve_kda_backend(backend: str, device: torch.device) -> str:
    """The KDA kernel ``backend`` runs on ``device`` (``"auto"`` through :func:`auto_kda_backend`)."""
    return KDA_BACKEND.resolve(backend, device)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The in-kernel form ``x / sqrt(Σx² + eps)`` (differs from ``x / max(‖x‖, eps)`` only near zero)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None, conv_state: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [B,T,D]`` (fp32) with weight ``[D,1,W]``: left context only; never reads across a document boundary.

    ``conv_state [B,W−1,D]``: the (pre-conv) inputs of the preceding positions when continuing a sequence
    (None = the sequence starts here: zero left context)."""
    W = weight.shape[-1]
    if conv_state is not None:
        if doc_ids is not None:
            raise ValueError("a carried conv_state continues one document per row; packed doc_ids are not supported")
        full = torch.cat([conv_state, x], dim=1)  # the carried inputs play the role of the earlier tokens
        return causal_depthwise_conv(full, weight, None)[:, conv_state.shape[1] :]
    if doc_ids is None:
        y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight, groups=x.shape[-1])
        return y.transpose(1, 2)
    # Packed rows: accumulate shifted taps, dropping taps whose source token belongs to another document.
    y = x * weight[:, 0, W - 1]
    for shift in range(1, W):
        src = F.pad(x, (0, 0, shift, 0))[:, : x.shape[1]]
        same = F.pad(doc_ids, (shift, 0), value=-1)[:, : x.shape[1]] == doc_ids
        y = y + src * same[..., None] * weight[:, 0, W - 1 - shift]
    return y


def roll_conv_state(conv_state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The conv state ``[B,W−1,D]`` after the inputs ``x [B,T,D]``: the last ``W−1`` of ``conv_state ‖ x``."""
    full = torch.cat([conv_state, x], dim=1)
    return full[:, full.shape[1] - conv_state.shape[1] :]


@dataclass
class KDAFinalState:
    """What :meth:`KimiDeltaAttention.forward` returns with ``output_final_state``: the carried state after the
    tokens, plus what a cache needs to shorten that step later (replay from the step's ``initial_state``)."""

    recurrent_state: torch.Tensor  # S_T [B,h,K,V] fp32
    conv_state: list[torch.Tensor]  # 3 × [B,W−1,D] fp32 raw (pre-conv) q/k/v projections of the last W−1 tokens
    projections: list[torch.Tensor]  # 3 × [B,T,D] fp32 raw q/k/v projections of the step's tokens
    recurrence_inputs: tuple[torch.Tensor, ...]  # (q, k, v, g, beta) of the step's tokens


class KimiDeltaAttention(nn.Module):
    """KDA with parameter names of the released checkpoint (``A_log`` is per head, ``[num_heads]``). ``backend``: the
    recurrence's :data:`KDA_BACKEND` (the model's ``kda_backend``; a settable attribute)."""

    backend = BackendSetting(KDA_BACKEND)

    def __init__(self, config: KimiK3TextConfig, backend: str = "auto") -> None:
        super().__init__()
        lac = config.linear_attn_config
        H = config.hidden_size
        self.num_heads, self.head_dim = lac["num_heads"], lac["head_dim"]
        self.lower_bound = float(lac["gate_lower_bound"])
        D = self.num_heads * self.head_dim
        W = lac["short_conv_kernel_size"]
        self.q_proj = nn.Linear(H, D, bias=False)
        self.k_proj = nn.Linear(H, D, bias=False)
        self.v_proj = nn.Linear(H, D, bias=False)
        self.q_conv1d = nn.Conv1d(D, D, W, groups=D, bias=False)
        self.k_conv1d = nn.Conv1d(D, D, W, groups=D, bias=False)
        self.v_conv1d = nn.Conv1d(D, D, W, groups=D, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(D))
        self.f_a_proj = nn.Linear(H, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, D, bias=False)
        self.b_proj = nn.Linear(H, self.num_heads, bias=False)
        self.g_proj = nn.Linear(H, D, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.head_dim))
        self.o_norm_eps = config.rms_norm_eps
        self.o_proj = nn.Linear(D, H, bias=False)
        self.backend = backend
        self.chunk_size = safe_chunk_size(self.lower_bound, max_chunk=16)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log forget gate in ``(lower_bound, 0)``, fp32 ``[B,T,n,d]``."""
        graw = self.f_b_proj(self.f_a_proj(x)).float().unflatten(-1, (self.num_heads, self.head_dim))
        rate = self.A_log.float().exp()[:, None] * (graw + self.dt_bias.float().view(self.num_heads, self.head_dim))
        return self.lower_bound * torch.sigmoid(rate)

    def recurrence(
        self, q, k, v, g, beta, initial_state=None, output_final_state: bool = False, backend: str | None = None
    ):
        """The delta-rule recurrence with this layer's scale; ``backend`` overrides the layer's own choice."""
        backend = resolve_kda_backend(backend or self.backend, q.device)
        scale = kda_scale(self.head_dim)
        state = {"initial_state": initial_state, "output_final_state": output_final_state}
        if backend == "naive":
            return naive_recurrent_kda(q, k, v, g, beta, scale, **state)
        if backend == "chunk":
            return chunk_kda(q, k, v, g, beta, scale, self.chunk_size, **state)
        kernel = "chunk" if backend == "fla_chunk" else "fused_recurrent"
        return fla_kda(q, k, v, g, beta, scale, kernel=kernel, **state)

    def forward(
        self,
        x: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        conv_state: list[torch.Tensor] | None = None,
        output_final_state: bool = False,
        backend: str | None = None,
    ):
        """``x [B,T,H]`` is the normalised layer input.

        ``token_mask [B,T]``: a binary mask (1 = token, one document per row, left or right padding) or an
        indexed packing mask (1..n = document id, 0 = padding); state and conv restart at every document.

        Continuing a sequence (incremental decoding; flash-linear-attention names): ``initial_state [B,h,K,V]``
        (fp32, None = zeros) and ``conv_state`` (3 × ``[B,W−1,D]`` raw q/k/v projections of the preceding tokens,
        None = none); ``output_final_state`` returns ``(o, KDAFinalState)`` instead of ``o``. ``backend``
        overrides the layer's recurrence backend for this call.
        """
        B, T, _ = x.shape
        n, d = self.num_heads, self.head_dim
        doc_ids = None
        keep = None
        if token_mask is not None:
            keep = token_mask != 0
            if token_mask.max() > 1:
                doc_ids = token_mask.long()
        if doc_ids is not None and (initial_state is not None or conv_state is not None or output_final_state):
            raise ValueError("KDA state passing continues one document per row; packed token masks are not supported")
        streams, projections = [], []
        convs = ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d))
        for i, (proj, conv) in enumerate(convs):
            h = proj(x).float()
            if keep is not None:
                # Zero projections at padding: with no conv bias and S_0 = 0 this equals unpadding.
                h = h * keep[..., None]
            tail = None if conv_state is None else conv_state[i]
            streams.append(F.silu(causal_depthwise_conv(h, conv.weight.float(), doc_ids, tail)))
            projections.append(h)
        q, k, v = (s.view(B, T, n, d) for s in streams)
        q, k = l2_normalize(q), l2_normalize(k)
        g = self.decay(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        if keep is not None:
            # No decay and no write at padding: the state passes through padding unchanged.
            g = g * keep[..., None, None]
            beta = beta * keep[..., None]
        final = None
        if doc_ids is not None:
            o = self._per_document(q, k, v, g, beta, doc_ids)
        elif output_final_state:
            o, S = self.recurrence(q, k, v, g, beta, initial_state, True, backend)
            W1 = self.q_conv1d.weight.shape[-1] - 1
            tails = conv_state or [h.new_zeros(B, W1, n * d) for h in projections]
            new_tails = [roll_conv_state(t, h) for t, h in zip(tails, projections)]
            final = KDAFinalState(S, new_tails, projections, (q, k, v, g, beta))
        else:
            o = self.recurrence(q, k, v, g, beta, initial_state, False, backend)
        o32 = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.o_norm_eps) * self.o_norm.weight.float()
        gate = torch.sigmoid(self.g_proj(x).float().view(B, T, n, d))
        o = (o32 * gate).to(x.dtype).reshape(B, T, n * d)
        if keep is not None:
            o = o * keep[..., None].to(o.dtype)
        o = self.o_proj(o)
        return (o, final) if output_final_state else o

    def _per_document(self, q, k, v, g, beta, doc_ids: torch.Tensor) -> torch.Tensor:
        """Unpad packed rows into one row per document (varlen), run the recurrence, scatter back."""
        segments = []
        for b in range(doc_ids.shape[0]):
            for doc in doc_ids[b].unique().tolist():
                if doc == 0:
                    continue
                segments.append((b, (doc_ids[b] == doc).nonzero().squeeze(-1)))
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        if not segments:
            return out
        Lmax = max(len(idx) for _, idx in segments)

        def gather(t: torch.Tensor) -> torch.Tensor:
            rows = [F.pad(t[b, idx], (0,) * (2 * (t.dim() - 2)) + (0, Lmax - len(idx))) for b, idx in segments]
            return torch.stack(rows)

        o = self.recurrence(gather(q), gather(k), gather(v), gather(g), gather(beta))
        for i, (b, idx) in enumerate(segments):
            out[b, idx] = o[i, : len(idx)]
        return out
