"""DSpark attention of block queries over ``[context ; block]`` MLA latents, in two forms with one signature
``(attn, q, context, block, allowed, core) -> o [B,n,S,d_v]``:

* :func:`latent_attention` (``kv_cache="latent"``, the default): the absorbed MLA form vLLM's decode runs (``W_UK`` /
  ``W_UV`` from ``kv_b_proj``): the query becomes ``[q_nope·W_UK ‖ q_rope]`` and attends, as one K/V head shared by
  all heads (MQA), to ``[latent ‖ k_pe]``, the values being the latent; ``W_UV`` maps the result back. Keys stay
  ``kv_lora_rank + d_rope`` wide per token, so a long context costs ``T·576`` per layer, not ``T·n·(d_qk+d_v)``;
* :func:`expanded_attention` (``kv_cache="expanded"``, the readable twin): per-head keys and values from
  ``kv_b_proj`` (:meth:`DeepseekMLAAttention.expand_latent`) and the plain MLA core.

``context`` / ``block``: ``(latent [B,1,·,r], rotated k_pe [B,1,·,d_rope])``; ``allowed [B,1,S,T+S]`` boolean (True
= may attend); ``core``: ``"eager"`` (explicit fp32 scores) or ``"sdpa"`` (``F.scaled_dot_product_attention``).
Both forms compute ``softmax(q·kᵀ·scale)·v`` with the same ``q``, ``k = [kv_b_nope(latent) ‖ k_pe]`` and
``v = kv_b_v(latent)``; only the association of the products differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_eagle.ops.mla import MLA_CORES, additive_mask

SDPA_HEAD_GROUP = 8  # query heads per SDPA call of the latent form (the comment in latent_attention says why)


def expanded_attention(attn, q, context, block, allowed, core: str) -> torch.Tensor:
    """Per-head K/V (the readable twin, module docstring)."""
    k_ctx, v_ctx = attn.expand_latent(*context)
    k_blk, v_blk = attn.expand_latent(*block)
    k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
    return MLA_CORES[core](q, k, v, allowed, attn.scale)


def latent_attention(attn, q, context, block, allowed, core: str) -> torch.Tensor:
    """The absorbed MLA form over the latents (module docstring)."""
    n, d_nope, d_v, r = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    weight = attn.kv_b_proj.weight.view(n, d_nope + d_v, r)
    w_uk, w_uv = weight[:, :d_nope], weight[:, d_nope:]
    q_nope, q_rope = q.split([d_nope, attn.qk_rope_head_dim], dim=-1)
    query = torch.cat([torch.einsum("bnsd,ndr->bnsr", q_nope, w_uk), q_rope], dim=-1)
    latent = torch.cat([context[0], block[0]], dim=2)  # [B,1,T+S,r]: the values too
    keys = torch.cat([latent, torch.cat([context[1], block[1]], dim=2)], dim=-1)
    if core == "eager":
        scores = torch.matmul(query, keys.transpose(-1, -2)).float() * attn.scale  # heads broadcast over the one key
        probs = torch.softmax(scores + additive_mask(allowed, torch.float32), dim=-1).to(latent.dtype)
        out = torch.matmul(probs, latent)
    elif core == "sdpa":
        # the one key head as a stride-0 view per query head, not enable_gqa: with a mask the kernel CUDA picks is the
        # memory-efficient one, which torch 2.13 documents without GQA; enable_gqa there would fall back to the math
        # kernel and its [n, S, T+S] scores. Its backward writes per-head key/value gradients ([h, T+S, r + d_rope]
        # each, before the view sums them): SDPA_HEAD_GROUP heads per call bound that transient at long contexts.
        B, n = query.shape[:2]
        parts = [
            F.scaled_dot_product_attention(
                q,
                keys.expand(B, q.shape[1], -1, -1),
                latent.expand(B, q.shape[1], -1, -1),
                attn_mask=allowed,
                scale=attn.scale,
            )
            for q in query.split(SDPA_HEAD_GROUP, dim=1)
        ]
        out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    else:
        raise ValueError(f"unknown attention core {core!r}; choose 'eager' or 'sdpa'")
    return torch.einsum("bnsr,ndr->bnsd", out, w_uv)


ATTENTION_FORMS = {"latent": latent_attention, "expanded": expanded_attention}
