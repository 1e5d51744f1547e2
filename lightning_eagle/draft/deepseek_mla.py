"""The served-draft variant (``architecture="deepseek_mla"``): one DeepSeek-V3 MLA layer in the EAGLE-3 frame, the
layer SGLang (``python/sglang/srt/models/kimi_k25_eagle3.py``) and vLLM (``vllm/model_executor/models/
deepseek_eagle3.py``) run as ``Eagle3DeepseekV2ForCausalLM``, and that the public ``kimi-k3-eagle3-mla`` drafts use.

Differences from the K3-faithful layer (:class:`~lightning_eagle.draft.model.KimiK3Eagle3Layer`):

* attention: the ``d_rope`` slice of q (per head) and of the shared key part ``k_rot`` is rotated with
  **interleaved** RoPE (:mod:`lightning_eagle.ops.rotary`; optional DeepSeek YaRN), keys are cached *after*
  rotation, the softmax scale is ``d_qk^−½`` times YaRN's ``mscale(s, mscale_all_dim)²``; no output gate;
* MLP: SwiGLU, ``down(silu(gate(x)) ⊙ up(x))`` (engines fuse ``gate_proj``/``up_proj`` into ``gate_up_proj``);
* norms: :class:`DeepseekRMSNorm`, the engine's order of operations (below);
* ``fc_norm`` (one norm per aux chunk before ``fc``) and ``norm_output`` (the next step gets the normed hidden) are
  optional, as in vLLM 0.32's head (``deepseek_eagle3.py``: ``DeepseekV2Eagle3Model``), which serves both.

Positions of a TTT step (the convention this module trains with). The engines give the draft the *target's*
positions: the draft-extend pass pairs the target hidden state at position t with token x_{t+1} at position t
(vLLM ``EagleProposer.propose``: ``positions = target_positions``; SGLang draft extend), and every further draft
step adds one (vLLM ``positions += 1``; SGLang ``forward_batch.positions.add_(1)`` in ``draft_forward``). TTT step k
of slot t is exactly the k-th further step of a chain that started at position t, so its queries and the keys it
appends use position **t + k** — which is also what the TTT trainers do (TorchSpec
``torchspec/models/draft/deepseek_eagle.py``: ``position_ids + lck`` with ``lck`` = cached steps; SpecForge's
Llama draft the same). Consequently the step-0 keys of slot j sit at position j and slot t's own step-i key at
t + i, i.e. every key carries the position an engine's KV cache would give it. :meth:`DeepseekMLAEagle3Draft.
step_positions` applies this default (``arange(T) + len(cache)``) when ``ttt_loss`` passes no positions; rows are
right-padded, so slot t is position t in every row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.draft.model import Eagle3DecoderLayer, KimiK3Eagle3Draft, register_draft_architecture
from lightning_eagle.ops.mla import expand_latent_kv
from lightning_eagle.ops.rotary import InterleavedRotary, attention_scale


def engine_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) · w`` with the variance, the normalisation *and the weight product* in fp32, one cast at the end.

    That is SGLang's ``RMSNorm`` (``forward_native``: ``(x * self.weight).to(orig_dtype)``; its CUDA kernel the same)
    — SGLang ships the K3 MLA draft head. K3's norm (:mod:`lightning_eagle.ops.norm`) and vLLM's ``forward_native``
    cast *before* the weight. The orders agree exactly in fp32 and differ by at most one rounding in bf16; the output
    always has ``x``'s dtype (an engine never promotes)."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(torch.float32)).to(x.dtype)


class DeepseekRMSNorm(nn.Module):
    """Plain RMSNorm as the serving engines compute it (:func:`engine_rms_norm`); weight initialised to ones."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return engine_rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) ⊙ up_proj(x))`` — DeepSeek's dense MLP (``hidden_act="silu"``)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekMLAAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention projections over the 2H input, rotary on the rope slice.

    ``q = q_b(norm(q_a(x)))`` → per head ``[q_nope | q_rope]``; ``[latent | k_rot] = kv_a_proj_with_mqa(x)``;
    ``[k_nope | v] = kv_b(norm(latent))`` per head; ``k = [k_nope | rope(k_rot)]`` with ``k_rot`` shared by all
    heads (one K/V head per query head after expansion). The attention core is the caller's (TTT cache or inference).

    ``config`` is any config with these field names (:class:`Eagle3DraftConfig`, the DSpark draft's config);
    ``norm_class`` builds the two latent norms (default :class:`DeepseekRMSNorm`). :meth:`project` is
    :meth:`project_query` + :meth:`project_latent` + :meth:`expand_latent`; the DSpark drafter uses the pieces, since
    its context keys come from ``kv_a_proj_with_mqa`` alone.
    """

    def __init__(
        self, config: Eagle3DraftConfig, input_size: int, output_size: int, norm_class: type[nn.Module] | None = None
    ) -> None:
        super().__init__()
        c, eps = config, config.rms_norm_eps
        norm_class = norm_class or DeepseekRMSNorm
        self.num_heads = c.num_attention_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        self.qk_head_dim = c.qk_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.q_a_proj = nn.Linear(input_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = norm_class(c.q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(input_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = norm_class(c.kv_lora_rank, eps=eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * c.v_head_dim, output_size, bias=False)
        self.rotary = InterleavedRotary(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
        self.scale = attention_scale(self.qk_head_dim, c.rope_scaling)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B,T,in]``, ``positions [B,T]`` or ``[T]`` → ``q, k [B,n,T,d_qk]`` (rope slices rotated), ``v``."""
        return (self.project_query(x, positions), *self.expand_latent(*self.project_latent(x, positions)))

    def project_query(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [B,T,in]`` → ``q [B,n,T,d_qk]`` = ``[q_nope | rope(q_rope)]``."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q.transpose(1, 2).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return torch.cat([q_nope, self.rotary(q_rope, positions)], dim=-1)

    def project_latent(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B,T,in]`` → the normalised KV latent ``[B,1,T,kv_lora_rank]`` and the rotated shared rope key
        ``[B,1,T,d_rope]``: what an engine's MLA cache holds per token."""
        B, T, _ = x.shape
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rot = self.rotary(k_rot.view(B, 1, T, self.qk_rope_head_dim), positions)
        return self.kv_a_layernorm(latent)[:, None], k_rot

    def expand_latent(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``latent [B,1,T,r]``, ``k_rot [B,1,T,d_rope]`` → ``k [B,n,T,d_qk]``, ``v [B,n,T,d_v]`` (``kv_b_proj``)."""
        return expand_latent_kv(self.kv_b_proj.weight, latent, k_rot, self.num_heads, self.qk_nope_head_dim)


class DeepseekMLAEagle3Layer(Eagle3DecoderLayer):
    """The EAGLE-3 fused layer with DeepSeek MLA + SwiGLU + engine RMSNorm (module docstring)."""

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = DeepseekRMSNorm(H, eps=eps)
        self.hidden_norm = DeepseekRMSNorm(H, eps=eps)
        self.self_attn = DeepseekMLAAttention(config, input_size=2 * H, output_size=H)
        self.post_attention_layernorm = DeepseekRMSNorm(H, eps=eps)
        self.mlp = SwiGLUMLP(H, config.intermediate_size)

    def qkv(self, combined, positions):
        if positions is None:
            raise ValueError("the deepseek_mla layer rotates q and k: it needs the positions of this step")
        return self.self_attn.project(combined, positions)

    def attention_output(self, o, combined):
        del combined  # no output gate
        return self.self_attn.o_proj(o)


@register_draft_architecture
class DeepseekMLAEagle3Draft(KimiK3Eagle3Draft):
    """EAGLE-3 draft for the K3 target with the DeepSeek MLA layer that SGLang / vLLM serve
    (``Eagle3DeepseekV2ForCausalLM``). Same frame, training path, TTT backends and inference as the K3-faithful
    draft; built by :func:`~lightning_eagle.draft.build_draft` when ``config.architecture == "deepseek_mla"``."""

    architecture = "deepseek_mla"
    layer_class = DeepseekMLAEagle3Layer
    norm_class = DeepseekRMSNorm

    def step_positions(
        self, input_ids: torch.Tensor, step: int, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``position_ids`` when given, else the TTT convention: slot t of step k at position ``t + k``."""
        if position_ids is not None:
            return position_ids
        return torch.arange(input_ids.shape[-1], device=input_ids.device) + step
