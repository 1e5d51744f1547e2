"""NoPE multi-head latent attention (MLA) with Q-LoRA, a KV latent, a shared unrotated rope slice and a sigmoid
output gate. The K3 target uses it on ``H``-wide inputs; the EAGLE-3 draft on the ``2H``-wide fused input.

There is no rotary module: position enters only through the causal mask (and, in the target, through KDA).

The attention core has two twins with one signature ``(q, k, v, mask, scale) -> o``: :func:`eager_attention` (the
readable form, fp32 ``[B,n,T,L]`` scores) and :func:`sdpa_attention` (``F.scaled_dot_product_attention``: flash or
memory-efficient kernels that never hold the scores). The setting ``mla_backend`` (:data:`MLA_BACKEND`) picks one;
``"auto"`` is ``sdpa`` on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_eagle.backends import BackendRegistry, BackendSetting
from lightning_eagle.ops.norm import K3RMSNorm

MLA_BACKEND = BackendRegistry(
    setting="mla_backend",
    what="MLA attention backend",
    names={
        "sdpa": "F.scaled_dot_product_attention: flash / memory-efficient kernels that never hold the scores",
        "eager": "explicit fp32 [B,n,T,L] scores: the readable twin",
    },
    auto=lambda device: "sdpa",  # the fused kernels run (and are at least as accurate) on every device
)


class NoPEMLA(nn.Module):
    """Projections and output gate of K3's MLA. ``forward`` runs causal attention with the core named by
    ``mla_backend`` (:data:`MLA_BACKEND`: ``"auto"``, the default, = ``"sdpa"``, or ``"eager"``; a settable attribute).

    Subclasses / callers that need another attention core (the draft's TTT cache) use :meth:`project` and
    :meth:`gate_output` around their own score computation.
    """

    mla_backend = BackendSetting(MLA_BACKEND)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        latent_norm_eps: float = 1e-6,
        use_output_gate: bool = True,
        mla_backend: str = "auto",
    ) -> None:
        super().__init__()
        self.mla_backend = mla_backend
        self.num_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = self.qk_head_dim**-0.5
        if q_lora_rank is None:
            self.q_proj = nn.Linear(input_size, num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(input_size, q_lora_rank, bias=False)
            self.q_a_layernorm = K3RMSNorm(q_lora_rank, eps=latent_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(input_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = K3RMSNorm(kv_lora_rank, eps=latent_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.g_proj = nn.Linear(input_size, num_heads * v_head_dim, bias=False) if use_output_gate else None
        self.o_proj = nn.Linear(num_heads * v_head_dim, output_size, bias=False)

    @classmethod
    def from_config(cls, config, input_size: int, output_size: int, latent_norm_eps: float) -> NoPEMLA:
        """Build from any config with the K3 MLA field names (target text config or draft config)."""
        return cls(
            input_size=input_size,
            output_size=output_size,
            num_heads=config.num_attention_heads,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            latent_norm_eps=latent_norm_eps,
            use_output_gate=config.mla_use_output_gate,
        )

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B,T,in]`` → ``q, k [B,n,T,d_qk]`` and ``v [B,n,T,d_v]``."""
        q, latent, k_rot = self.project_latent(x)
        k, v = self.expand_latent(latent, k_rot)
        return q, k, v

    def project_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B,T,in]`` → ``q [B,n,T,d_qk]``, the normalised KV latent ``[B,1,T,kv_lora_rank]`` and the shared rope
        key ``[B,1,T,d_rope]``: the compressed keys/values that :meth:`expand_latent` turns into per-head ones."""
        B, T, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.num_heads, self.qk_head_dim).transpose(1, 2)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return q, self.kv_a_layernorm(latent)[:, None], k_rot[:, None]

    def expand_latent(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``latent [B,1,T,r]`` and ``k_rot [B,1,T,d_rope]`` → ``k [B,n,T,d_qk]``, ``v [B,n,T,d_v]`` (``kv_b_proj``)."""
        return expand_latent_kv(self.kv_b_proj.weight, latent, k_rot, self.num_heads, self.qk_nope_head_dim)

    def gate_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o [B,T,n·d_v]`` → gated by ``σ(g_proj(x))`` (the layer input, not the attention output) → ``o_proj``."""
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Causal attention over ``x [B,T,in]``. ``mask`` over the ``L`` keys, ``[B|1,1,T,L]``: boolean (True = may
        attend, see :func:`causal_allowed_mask`) or additive (0 / ``finfo.min``, see :func:`causal_additive_mask`);
        None = causal. ``cache``: a key/value cache whose ``update(k, v)`` appends this call's keys and values and
        returns all of them (incremental decoding: the ``T`` new tokens attend to the cached prefix and, causally,
        to each other)."""
        q, k, v = self.project(x)
        if cache is not None:
            k, v = cache.update(k, v)
        attend = MLA_CORES[MLA_BACKEND.resolve(self.mla_backend, x.device)]
        o = attend(q, k, v, mask, self.scale)
        B, n, T, _ = q.shape
        return self.gate_output(o.transpose(1, 2).reshape(B, T, n * self.v_head_dim), x)


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``softmax(q·kᵀ·scale + mask) · v`` with explicit fp32 ``[B,n,T,L]`` scores (the readable twin).

    ``q, k [B,n,T|L,d_qk]``, ``v [B,n,L,d_v]`` → ``[B,n,T,d_v]``. ``mask`` as in :meth:`NoPEMLA.forward`; None =
    causal with the ``L − T`` cached keys in front of the queries."""
    T, L = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        mask = causal_allowed_mask(None, T, q.device, past_length=L - T)
    if mask.dtype == torch.bool:
        mask = additive_mask(mask, torch.float32)
    probs = torch.softmax(scores.float() + mask.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """:func:`eager_attention` through ``F.scaled_dot_product_attention`` (same signature and result).

    **Widths.** K3's qk head (nope + rope = 192) is wider than its v head (128). q, k and v are zero-padded to one
    width and the output sliced back: zero v columns give zero output columns and zero q/k columns add nothing to
    the scores (``scale`` is passed explicitly, so the padded width does not change it). Padding is chosen over
    relying on a backend that takes ``d_v ≠ d_qk`` because the flash kernels need equal widths — torch's CUDA
    flash kernel and the fused CPU kernel alike (on CPU, unequal widths fall back to the math backend, which
    materialises the scores); the cost is a 1.5x wider ``P·v`` product and one copy of v per call.

    **Masks.** None without a cached prefix → ``is_causal=True`` and no mask tensor (flash-eligible); one query
    after a prefix sees every key (no mask); several queries after a prefix get a boolean ``[T,L]`` causal mask
    (``is_causal`` would align the diagonal top-left). Boolean masks pass through; additive masks are read as
    boolean (``mask == 0`` allowed), exact for the 0 / very-negative masks this library builds. Note that torch
    turns a boolean mask into an additive one of q's dtype inside each call (a transient ``[B,1,T,L]``), and that
    any mask tensor rules out the CUDA flash kernel (memory-efficient or cuDNN run instead) and causal block
    skipping; only the unpadded causal case is mask-free.

    **Precision.** fp32 inputs are computed in fp32; the fused kernels accumulate bf16/fp16 inputs in fp32 (scores,
    softmax statistics and the ``P·v`` sums), at least as accurate as the eager twin, whose bf16 scores are rounded
    before its fp32 softmax. **Finiteness.** Every row of the masks built here allows at least one key (a padding
    query sees key 0), so no row is empty and no NaN appears."""
    T, L = q.shape[-2], k.shape[-2]
    d_v = v.shape[-1]
    width = max(q.shape[-1], d_v)
    q, k, v = (_pad_last(t, width) for t in (q, k, v))
    is_causal = False
    if mask is None:
        if L == T:
            is_causal = True
        elif T > 1:
            mask = causal_allowed_mask(None, T, q.device, past_length=L - T)
    elif mask.dtype != torch.bool:
        mask = mask == 0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    return out[..., :d_v]


MLA_CORES = {"sdpa": sdpa_attention, "eager": eager_attention}


def expand_latent_kv(
    kv_b_weight: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, num_heads: int, qk_nope_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's key/value expansion: ``[k_nope ‖ v] = kv_b(latent)`` per head, ``k = [k_nope ‖ k_rot]`` with the rope part
    shared by every head (MQA-style; neither normalised nor rotated here). ``latent [B,1,T,r]`` (normalised),
    ``k_rot [B,1,T,d_rope]``, ``kv_b_weight [n·(d_nope+d_v), r]`` → ``k [B,n,T,d_qk]``, ``v [B,n,T,d_v]``."""
    B, _, T, _ = latent.shape
    width = kv_b_weight.shape[0] // num_heads
    kv = F.linear(latent[:, 0], kv_b_weight).view(B, T, num_heads, width)
    k_nope, v = kv.transpose(1, 2).split([qk_nope_head_dim, width - qk_nope_head_dim], dim=-1)
    k_rot = k_rot.expand(B, num_heads, T, k_rot.shape[-1])
    return torch.cat([k_nope, k_rot], dim=-1), v


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def causal_allowed_mask(
    attention_mask: torch.Tensor | None,
    T: int,
    device: torch.device | str,
    past_length: int = 0,
) -> torch.Tensor:
    """Boolean ``[B|1,1,T,past_length+T]``, True where a query may attend: causal ∧ key-not-padding; a padding
    query row may attend to key 0 only. ``past_length`` keys (a cached prefix) precede the ``T`` queries;
    ``attention_mask`` covers all keys."""
    allowed = torch.ones(T, past_length + T, dtype=torch.bool, device=device).tril(past_length)[None, None]
    if attention_mask is not None:
        keep = attention_mask.to(device=device, dtype=torch.bool)
        allowed = allowed & keep[:, None, None, :]
        # A padding query attends to key 0 only, so its softmax stays finite; its output is ignored downstream.
        key0 = (torch.arange(past_length + T, device=device) == 0).expand(T, past_length + T)
        allowed = torch.where(keep[:, None, past_length:, None], allowed, key0)
    return allowed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean mask → additive: 0 where allowed, ``finfo(dtype).min`` elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def causal_additive_mask(
    attention_mask: torch.Tensor | None,
    T: int,
    dtype: torch.dtype,
    device: torch.device | str,
    past_length: int = 0,
) -> torch.Tensor:
    """Additive form of :func:`causal_allowed_mask` (0 where allowed, ``finfo(dtype).min`` elsewhere)."""
    return additive_mask(causal_allowed_mask(attention_mask, T, device, past_length), dtype)
