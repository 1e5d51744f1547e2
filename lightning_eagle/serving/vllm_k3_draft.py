"""``Eagle3KimiK3ForCausalLM`` for vLLM: the K3-faithful EAGLE-3 draft (``architecture="k3"``) built from vLLM's own
layers, so a draft trained with the default architecture is served as trained. Imported by vLLM only, through the
plugin (:mod:`lightning_eagle.serving.vllm_plugin`); nothing in ``lightning_eagle`` imports it.

The layer (`eagle3_training.md` §3, :class:`lightning_eagle.draft.model.KimiK3Eagle3Layer`), over the 2H input
``x = [input_layernorm(embed) ‖ hidden_norm(h)]``:

* attention: K3's NoPE gated MLA, i.e. vLLM's :class:`MultiHeadLatentAttentionWrapper` with ``rotary_emb=None`` (the
  rope slice of q and of the shared key is carried unrotated) and its output gate ``g_proj``: ``o_proj(attn ⊙
  σ(g_proj(x)))``; softmax scale ``d_qk^-½``; the latent norms use ``rms_norm_eps`` like our draft;
* MLP: SiTU, ``down(β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin))`` with ``[g | u] = gate_up(h)``, in fp32 like
  :func:`lightning_eagle.ops.situ.situ_and_mul` (written again here: this module must import only torch and vLLM);
* norms: vLLM's :class:`RMSNorm`, whose order (fp32 variance, cast, then the weight) is K3's;
* the frame (``fc``, ``fc_norm``, ``norm``, ``lm_head``, ``d2t``, the residual, ``norm_output``, weight loading and
  the fused ``q_a``/``kv_a`` and ``gate``/``up`` projections) is vLLM's ``DeepseekV2Eagle3`` one. The class subclasses
  :class:`Eagle3DeepseekV2ForCausalLM` because vLLM's EAGLE proposer accepts EAGLE-3 heads by ``isinstance``.

Tensor parallelism as vLLM's MLA drafts shard: heads split over ranks (``q_b_proj``, ``kv_b_proj``, ``g_proj``
column-parallel, ``o_proj`` row-parallel), the fused ``q_a``/``kv_a`` projection replicated, the MLP column/row
parallel. Only TP 1 ran here (CPU).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.deepseek_eagle3 import DeepseekV2Eagle3Model, Eagle3DeepseekV2ForCausalLM
from vllm.model_executor.models.deepseek_v2 import DeepSeekV2FusedQkvAProjLinear
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix


def situ_and_mul(gate_up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """``[g | u]`` → ``β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)`` in fp32, cast back (a cap of None is dropped)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    linear = g if beta is None else beta * torch.tanh(g / beta)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (linear * torch.sigmoid(g) * u).to(gate_up.dtype)


class SituMLP(nn.Module):
    def __init__(self, config, quant_config, prefix: str) -> None:
        super().__init__()
        H, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            H, [inter] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            inter, H, bias=False, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )
        self.beta = getattr(config, "activation_situ_beta", None)
        self.linear_beta = getattr(config, "activation_situ_linear_beta", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(situ_and_mul(gate_up, self.beta, self.linear_beta))
        return out


class NoPEGatedMLA(nn.Module):
    """K3's MLA over the draft's 2H input: vLLM's MLA wrapper with no rotary and the ``g_proj`` output gate."""

    def __init__(self, vllm_config: VllmConfig, config, quant_config, prefix: str) -> None:
        super().__init__()
        if config.q_lora_rank is None:
            raise ValueError("Eagle3KimiK3ForCausalLM serves drafts with a Q-LoRA (q_lora_rank), got null")
        H, n = config.hidden_size, config.num_attention_heads
        nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        q_lora, kv_lora, eps = config.q_lora_rank, config.kv_lora_rank, config.rms_norm_eps
        tp = get_tensor_model_parallel_world_size()
        if n % tp:
            raise ValueError(f"{n} attention heads do not split over tensor-parallel size {tp}")
        self.fused_qkv_a_proj = DeepSeekV2FusedQkvAProjLinear(
            2 * H, [q_lora, kv_lora + rope], quant_config=quant_config, prefix=f"{prefix}.fused_qkv_a_proj"
        )
        self.q_a_layernorm = RMSNorm(q_lora, eps=eps)
        self.q_b_proj = ColumnParallelLinear(
            q_lora, n * (nope + rope), bias=False, quant_config=quant_config, prefix=f"{prefix}.q_b_proj"
        )
        self.kv_a_layernorm = RMSNorm(kv_lora, eps=eps)
        self.kv_b_proj = ColumnParallelLinear(
            kv_lora, n * (nope + v_dim), bias=False, quant_config=quant_config, prefix=f"{prefix}.kv_b_proj"
        )
        self.g_proj = ColumnParallelLinear(
            2 * H, n * v_dim, bias=False, quant_config=quant_config, prefix=f"{prefix}.g_proj"
        )
        self.o_proj = RowParallelLinear(n * v_dim, H, bias=False, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        modules = MLAModules(
            kv_a_layernorm=self.kv_a_layernorm,
            kv_b_proj=self.kv_b_proj,
            rotary_emb=None,  # NoPE: the rope slice is carried unrotated
            o_proj=self.o_proj,
            fused_qkv_a_proj=self.fused_qkv_a_proj,
            kv_a_proj_with_mqa=None,
            q_a_layernorm=self.q_a_layernorm,
            q_b_proj=self.q_b_proj,
            q_proj=None,
            indexer=None,
            is_sparse=False,
            topk_indices_buffer=None,
            g_proj=self.g_proj if getattr(config, "mla_use_output_gate", True) else None,
        )
        self.mla_attn = MultiHeadLatentAttentionWrapper(
            H, n // tp, (nope + rope) ** -0.5, nope, rope, v_dim, q_lora, kv_lora, modules,
            vllm_config.cache_config, quant_config, prefix,
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mla_attn(positions, hidden_states)


class KimiK3Eagle3DecoderLayer(nn.Module):
    """The fused first layer: ``h + attn([norm(e) ‖ norm(h)])``, then ``+ mlp(norm(·))`` (residual = the carried h)."""

    def __init__(self, vllm_config: VllmConfig, config, prefix: str) -> None:
        super().__init__()
        quant_config = get_draft_quant_config(vllm_config)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps=eps)
        self.hidden_norm = RMSNorm(H, eps=eps)
        self.self_attn = NoPEGatedMLA(vllm_config, config, quant_config, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(H, eps=eps)
        self.mlp = SituMLP(config, quant_config, prefix=f"{prefix}.mlp")

    def forward(self, positions, embeds, hidden_states, residual):
        # The first (only) layer: ``residual`` is None; the carried hidden state is the residual stream.
        combined = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1)
        attn = self.self_attn(positions, combined)
        hidden_states, residual = self.post_attention_layernorm(attn, hidden_states)  # fused add, then norm
        return self.mlp(hidden_states), residual


@support_torch_compile
class KimiK3Eagle3Model(nn.Module):
    """``DeepseekV2Eagle3Model``'s frame (embeddings, ``fc`` / ``fc_norm``, final norm, ``norm_output``, weight
    loading) around the K3 layer."""

    forward = DeepseekV2Eagle3Model.forward
    embed_input_ids = DeepseekV2Eagle3Model.embed_input_ids
    load_weights = DeepseekV2Eagle3Model.load_weights
    hf_to_vllm_mapper = DeepseekV2Eagle3Model.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0, prefix: str = "") -> None:
        super().__init__()
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        if config.num_hidden_layers != 1:
            raise ValueError(f"Eagle3KimiK3ForCausalLM drafts have one layer, got {config.num_hidden_layers}")
        self.vocab_size = config.vocab_size
        self.quant_config = get_draft_quant_config(vllm_config)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
        )
        layer_prefix = maybe_prefix(prefix, f"layers.{start_layer_id}")
        self.layers = nn.ModuleList([KimiK3Eagle3DecoderLayer(get_current_vllm_config(), config, layer_prefix)])
        ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        self.num_aux_hidden_states = len(ids) if ids else 3
        target_hidden_size = getattr(config, "target_hidden_size", config.hidden_size)
        self.fc = ReplicatedLinear(
            target_hidden_size * self.num_aux_hidden_states,
            config.hidden_size,
            bias=False,
            params_dtype=vllm_config.model_config.dtype,
            quant_config=self.quant_config,
            prefix=maybe_prefix(prefix, "fc"),
            return_bias=False,
        )
        self.fc_norm = None
        if getattr(config, "fc_norm", False):
            norms = [RMSNorm(target_hidden_size, eps=config.rms_norm_eps) for _ in range(self.num_aux_hidden_states)]
            self.fc_norm = nn.ModuleList(norms)
        self.norm_output = getattr(config, "norm_output", False)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Eagle3KimiK3ForCausalLM(Eagle3DeepseekV2ForCausalLM):
    """EAGLE-3 head of a K3-faithful ``lightning_eagle`` draft (module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        config.target_layer_count = target_layers
        self.model = KimiK3Eagle3Model(
            vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"), start_layer_id=target_layers
        )
        self.lm_head = ParallelLMHead(
            config.draft_vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head")
        )
        self.logits_processor = LogitsProcessor(config.draft_vocab_size, scale=getattr(config, "logit_scale", 1.0))
        self.draft_id_to_target_id = None
        if config.draft_vocab_size != vllm_config.model_config.get_vocab_size():
            self.draft_id_to_target_id = nn.Parameter(
                torch.zeros(config.draft_vocab_size, dtype=torch.long), requires_grad=False
            )
