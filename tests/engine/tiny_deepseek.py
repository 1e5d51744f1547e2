"""A tiny random DeepSeek-V3 target that vLLM's CPU build serves, in the Hugging Face layout (``config.json`` +
``model.safetensors``, the names vLLM's ``DeepseekV2ForCausalLM.load_weights`` reads).

Why DeepSeek-V3 and these shapes: on CPU, vLLM picks its MLA backend for an MLA draft (block size 16 only) and its
``CPU_ATTN`` backend for a non-MLA target (block sizes that are multiples of 32), and refuses the pair ("No common
block size"); an MLA target shares the draft's backend. vLLM's CPU MLA decode kernel runs head size 576 only
(K3's latent 512 + rope 64), so target and draft use that latent. Every layer is dense
(``first_k_dense_replace = num_hidden_layers``). The target's embedding is the one our draft was trained with
(the quickstart K3 target's), so the engine shares the same table with the draft (our exports omit a frozen one).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_tiny_deepseek_v3(folder: Path, embedding: torch.Tensor, num_layers: int, seed: int = 1234) -> Path:
    """Write the target to ``folder``; ``embedding`` ``[V, H]`` fixes the vocabulary and hidden size."""
    V, H = embedding.shape
    heads, nope, rope, v_dim, latent, inter = 4, 16, 64, 32, 512, 256
    g = torch.Generator().manual_seed(seed)  # not the seed the embedding came from: a random lm_head, not a copy

    def w(*shape):  # std ~ 1/sqrt(fan_in): activations neither vanish nor explode over the layers
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    state = {
        "model.embed_tokens.weight": embedding.float(),
        "model.norm.weight": torch.ones(H),
        "lm_head.weight": w(V, H),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = torch.ones(H)
        state[p + "post_attention_layernorm.weight"] = torch.ones(H)
        state[p + "self_attn.q_proj.weight"] = w(heads * (nope + rope), H)
        state[p + "self_attn.kv_a_proj_with_mqa.weight"] = w(latent + rope, H)
        state[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(latent)
        state[p + "self_attn.kv_b_proj.weight"] = w(heads * (nope + v_dim), latent)
        state[p + "self_attn.o_proj.weight"] = w(H, heads * v_dim)
        state[p + "mlp.gate_proj.weight"] = w(inter, H)
        state[p + "mlp.up_proj.weight"] = w(inter, H)
        state[p + "mlp.down_proj.weight"] = w(H, inter)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": V,
        "hidden_size": H,
        "intermediate_size": inter,
        "moe_intermediate_size": 32,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": num_layers,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": None,
        "kv_lora_rank": latent,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_dim,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
