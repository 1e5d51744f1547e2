"""NoPE multi-head latent attention (MLA) with Q-LoRA, a KV latent, a shared unrotated rope slice and a sigmoid
output gate. The K3 target uses it on ``H``-wide inputs; the EAGLE-3 draft on the ``2H``-wide fused input.

There is no rotary module: position enters only through the causal mask (and, in the target, through KDA).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_eagle.ops.norm import K3RMSNorm


class NoPEMLA(nn.Module):
    """Projections and output gate of K3's MLA. ``forward`` runs plain (eager) causal attention.

    Subclasses / callers that need another attention core (the draft's TTT cache) use :meth:`project` and
    :meth:`gate_output` around their own score computation.
    """

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
    ) -> None:
        super().__init__()
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
        B, T, _ = x.shape
        n = self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, n, self.qk_head_dim).transpose(1, 2)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, n, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # The rope slice is neither normalised nor rotated; it is one key part shared by every head (MQA-style).
        k_rot = k_rot.view(B, 1, T, self.qk_rope_head_dim).expand(B, n, T, self.qk_rope_head_dim)
        return q, torch.cat([k_nope, k_rot], dim=-1), v

    def gate_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o [B,T,n·d_v]`` → gated by ``σ(g_proj(x))`` (the layer input, not the attention output) → ``o_proj``."""
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Eager attention. ``mask``: additive ``[B|1,1,T,L]`` over the ``L`` keys (``finfo.min`` where disallowed);
        None = causal. ``cache``: a key/value cache whose ``update(k, v)`` appends this call's keys and values and
        returns all of them (incremental decoding: the ``T`` new tokens attend to the cached prefix and, causally,
        to each other)."""
        q, k, v = self.project(x)
        if cache is not None:
            k, v = cache.update(k, v)
        B, n, T, _ = q.shape
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if mask is None:
            mask = causal_additive_mask(None, T, scores.dtype, scores.device, past_length=k.shape[2] - T)
        probs = torch.softmax(scores.float() + mask.float(), dim=-1).to(v.dtype)
        o = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, n * self.v_head_dim)
        return self.gate_output(o, x)


def causal_additive_mask(
    attention_mask: torch.Tensor | None,
    T: int,
    dtype: torch.dtype,
    device: torch.device | str,
    past_length: int = 0,
) -> torch.Tensor:
    """Additive ``[B|1,1,T,past_length+T]`` mask: causal ∧ key-not-padding; a padding query row may attend to key 0
    only. ``past_length`` keys (a cached prefix) precede the ``T`` queries; ``attention_mask`` covers all keys."""
    allowed = torch.ones(T, past_length + T, dtype=torch.bool, device=device).tril(past_length)[None, None]
    if attention_mask is not None:
        keep = attention_mask.to(device=device, dtype=torch.bool)
        allowed = allowed & keep[:, None, None, :]
        # A padding query attends to key 0 only, so its softmax stays finite; its output is ignored downstream.
        key0 = (torch.arange(past_length + T, device=device) == 0).expand(T, past_length + T)
        allowed = torch.where(keep[:, None, past_length:, None], allowed, key0)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)
