"""The DSpark block drafter for K3 (`dspark.md`): vLLM 0.32's ``K3DSparkForCausalLM`` layout
(``vllm/models/kimi_k3/nvidia/dspark_mla.py``), trained here and served there.

Computation (what vLLM computes; its names):

* context: the target's states at the taps, concatenated ``[.., n_taps·H_t]`` → ``context_norm(context_proj(·))``,
  projected once; every layer turns it into keys/values with its **own** ``kv_a_proj_with_mqa`` → ``kv_a_layernorm``
  on the latent, RoPE on ``k_pe`` at the context positions (vLLM's ``precompute_and_store_context_kv``, written into
  each layer's latent cache). No per-layer input norm is applied to the context.
* block: per anchor ``p`` the inputs ``[embed(x_p), embed(mask) × (g-1)]`` at positions ``p..p+g-1``; N layers of
  ``x += o_proj(MLA(input_layernorm(x)))``, ``x += mlp(post_attention_layernorm(x))``, then ``final_norm``. A block
  query sees the context keys at positions ``< p`` and all ``g`` keys of its own block (vLLM's
  ``non_causal_multi_token_decode``); never another block.
* heads: base logits = the frozen target's ``lm_head`` of the slot states; the Markov head adds
  ``markov_w2(markov_w1[x_prev])`` (previous token: the anchor for slot 0, then the previous slot's token); the
  confidence head reads ``[h ; markov_w1[x_prev]]`` in fp32.

Parameter names are vLLM's checkpoint names, 1:1 (vLLM's loader then prefixes ``model.`` and stacks):

=================================================  ===========================================================
ours (= the exported name)                          vLLM parameter
=================================================  ===========================================================
``context_proj.weight``, ``context_norm.weight``    ``model.context_proj.weight``, ``model.context_norm.weight``
``layers.i.self_attn.q_a_proj.weight``              ``model.layers.i.self_attn.fused_qkv_a_proj.weight`` shard 0
``layers.i.self_attn.kv_a_proj_with_mqa.weight``    ``…fused_qkv_a_proj.weight`` shard 1, and
                                                    ``model.context_kv_proj.weight`` shard i
``layers.i.self_attn.{q_a_layernorm,kv_a_layernorm,q_b_proj,kv_b_proj,o_proj}.weight``  same under ``model.``
``layers.i.mlp.gate_proj`` / ``up_proj``            ``model.layers.i.mlp.gate_up_proj.weight`` shards 0 / 1
``layers.i.mlp.down_proj``, ``layers.i.{input,post_attention}_layernorm``, ``final_norm``  same under ``model.``
``markov_head.markov_w1.weight`` ``[V,r]``          ``model.markov_head.markov_w1.weight``
``markov_head.markov_w2.weight`` ``[V,r]``          ``model.markov_head.markov_w2.weight``
``confidence_head.proj.{weight,bias}``              ``model.confidence_head.proj.*`` (only with
                                                    ``enable_confidence_head``; fp32)
=================================================  ===========================================================

Norms are K3's (:class:`~lightning_eagle.ops.norm.K3RMSNorm`: fp32 variance, cast, then the weight), the order of
vLLM's RMSNorm. The MLA projections are :class:`~lightning_eagle.draft.deepseek_mla.DeepseekMLAAttention`, the one
home of RoPE'd MLA shared with the EAGLE-3 ``deepseek_mla`` draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_eagle.backends import BackendSetting
from lightning_eagle.draft.deepseek_mla import DeepseekMLAAttention, SwiGLUMLP
from lightning_eagle.draft.dspark_attention import ATTENTION_FORMS
from lightning_eagle.draft.dspark_config import DSparkDraftConfig
from lightning_eagle.draft.materialize import normal_init
from lightning_eagle.ops.mla import MLA_BACKEND
from lightning_eagle.ops.norm import K3RMSNorm
from lightning_eagle.run_settings import check_kv_cache

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: latent [B,1,T,r], rotated k_pe [B,1,T,d_rope]


class DSparkDecoderLayer(nn.Module):
    """One DSpark layer: pre-norm RoPE MLA over ``[context ; block]`` keys, pre-norm ``KimiMLP`` (SiLU)."""

    # Methods besides ``forward`` that read the layer's weights: an FSDP2-sharded drafter gathers them around these
    # calls too (``model.draft.shard``; :func:`~lightning_eagle.parallel.dense_shard.shard_draft`).
    fsdp_forward_methods = ("context_latent",)

    def __init__(self, config: DSparkDraftConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = K3RMSNorm(H, eps=eps)
        self.self_attn = DeepseekMLAAttention(config, input_size=H, output_size=H, norm_class=K3RMSNorm)
        self.post_attention_layernorm = K3RMSNorm(H, eps=eps)
        self.mlp = SwiGLUMLP(H, config.intermediate_size)

    def context_latent(self, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``context [B,T,H]`` (already ``context_norm``-ed) → this layer's latent and rotated ``k_pe``."""
        return self.self_attn.project_latent(context, positions)

    def forward(
        self,
        xs: list[torch.Tensor],
        positions: list[torch.Tensor],
        allowed: list[torch.Tensor],
        context: tuple[torch.Tensor, torch.Tensor],
        kv_cache: str,
        core: str,
    ) -> list[torch.Tensor]:
        """The layer over every anchor chunk of a call at once (an FSDP2-sharded layer is then gathered once for all
        of them, not once per chunk): chunk i is ``xs[i] [B,S,H]`` at ``positions[i] [B,S]`` with ``allowed[i]
        [B,1,S,T+S]``; ``context`` = this layer's context latent and rotated ``k_pe``."""
        return [self.block(x, p, context, a, kv_cache, core) for x, p, a in zip(xs, positions, allowed, strict=True)]

    def block(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor,
        kv_cache: str,
        core: str,
    ) -> torch.Tensor:
        """One chunk: ``x [B,S,H]`` block states at ``positions [B,S]``; ``allowed [B,1,S,T+S]`` boolean;
        ``kv_cache`` / ``core``: :mod:`~lightning_eagle.draft.dspark_attention`."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = attn.project_query(h, positions)
        o = ATTENTION_FORMS[kv_cache](attn, q, context, attn.project_latent(h, positions), allowed, core)
        B, n, S, _ = q.shape
        x = x + attn.o_proj(o.transpose(1, 2).reshape(B, S, n * attn.v_head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's vanilla sequential head: ``bias(x_prev) = markov_w2(markov_w1[x_prev])``, rank r."""

    fsdp_forward_methods = ("embed", "bias")  # it has no forward: these are its calls (DSparkDecoderLayer's note)

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_tokens)

    def bias(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """``prev_tokens [...]`` → ``[..., V]`` added to the base logits."""
        return self.markov_w2(self.markov_w1(prev_tokens))


class ConfidenceHead(nn.Module):
    """``logit(c_k) = proj([h_k ; markov_w1[x_prev]])``, computed in fp32 as vLLM's ``DSparkConfidenceHead``."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1).float()
        return F.linear(x, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


@dataclass
class BlockDraft:
    """What :meth:`DSparkDrafter.sample_block` returns: ``tokens [B,g]``, the distributions they were drawn from,
    ``probs [B,g,V]`` fp32 (one-hot of the argmax when greedy: the proposal a verifier must use), and the slots'
    ``logits [B,g,V]`` fp32 before any temperature (base + Markov bias of the token sampled before: what an
    analytic acceptance compares with the target at any temperature)."""

    tokens: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


class DSparkDrafter(nn.Module):
    """The DSpark block drafter (module docstring). The embedding and LM head are the frozen target's, passed to
    the calls that need them, never owned (so never saved or exported).

    ``mla_backend`` (:data:`~lightning_eagle.ops.mla.MLA_BACKEND`: ``auto`` = ``sdpa``, or ``eager``) picks the
    attention core, ``kv_cache`` (``latent``, or the ``expanded`` twin: :mod:`~lightning_eagle.draft.dspark_attention`)
    the form of the keys; ``block_chunk`` (None: all anchors at once) how many anchors one attention call takes;
    ``activation_checkpointing`` keeps only each layer's input through the forward and recomputes the layer (over all
    chunks) in the backward (a long row's ``A·g`` block rows would otherwise keep every layer's activations, the
    context-length ``[context ; block]`` keys of every chunk included)."""

    mla_backend = BackendSetting(MLA_BACKEND)

    def __init__(
        self,
        config: DSparkDraftConfig,
        mla_backend: str = "auto",
        block_chunk: int | None = 64,
        kv_cache: str = "latent",
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.kv_cache = check_kv_cache(kv_cache)
        if not isinstance(activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing must be a bool, got {activation_checkpointing!r}")
        self.activation_checkpointing = activation_checkpointing
        if block_chunk is not None and (isinstance(block_chunk, bool) or not isinstance(block_chunk, int)):
            raise ValueError(f"block_chunk must be a positive int or None, got {block_chunk!r}")
        if block_chunk is not None and block_chunk < 1:
            raise ValueError(f"block_chunk must be a positive int or None, got {block_chunk!r}")
        self.config, self.mla_backend, self.block_chunk = config, mla_backend, block_chunk
        H, eps = config.hidden_size, config.rms_norm_eps
        self.context_proj = nn.Linear(config.context_size, H, bias=False)
        self.context_norm = K3RMSNorm(H, eps=eps)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_norm = K3RMSNorm(H, eps=eps)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        self.confidence_head = ConfidenceHead(H + config.markov_rank) if config.enable_confidence_head else None

    def init_module(self, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters (one of this drafter's modules) as DeepSpec does: every Linear and
        Embedding weight N(0, ``config.initializer_range``), the Markov head's and the confidence head's included,
        biases 0, norm gains 1 (:func:`~lightning_eagle.draft.materialize.normal_init`;
        :data:`~lightning_eagle.draft.dspark_config.DEFAULT_INITIALIZER_RANGE` cites it). What
        :func:`~lightning_eagle.draft.materialize.materialize` runs."""
        normal_init(module, self.config.initializer_range)

    def fsdp_units(self) -> list[nn.Module]:
        """What ``model.draft.shard`` makes FSDP2 units: ``context_proj``, ``context_norm``, each decoder layer,
        ``final_norm``, the Markov head and the confidence head (:meth:`head_units`: what the objective reads as whole
        weights, outside any of their calls)."""
        return [self.context_proj, self.context_norm, *self.layers, self.final_norm, *self.head_units()]

    def head_units(self) -> list[nn.Module]:
        """The Markov head and the confidence head (when there is one)."""
        return [self.markov_head] + ([] if self.confidence_head is None else [self.confidence_head])

    # ---- context -----------------------------------------------------------------------------------------------
    def context_kv(self, context_features: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """``context_features [B,T,n_taps·H_t]`` at ``positions [T]`` or ``[B,T]`` → per layer the latent and the
        rotated ``k_pe`` (vLLM's latent cache entries for these tokens)."""
        expected = self.config.context_size
        if context_features.dim() != 3 or context_features.shape[-1] != expected:
            raise ValueError(
                f"context_features must be [B, T, {expected}] (num_target_layers {self.config.num_target_layers} x "
                f"target_hidden_size {self.config.target_hidden_size}), got {tuple(context_features.shape)}"
            )
        return self.context_kv_from_combined(self.combine_hidden_states(context_features), positions)

    def combine_hidden_states(self, context_features: torch.Tensor) -> torch.Tensor:
        """``context_norm(context_proj(·))``: the concatenated target states → the draft-width context (vLLM's
        ``combine_hidden_states``)."""
        return self.context_norm(self.context_proj(context_features))

    def context_kv_from_combined(self, context: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """The per-layer latents of an already combined context ``[B,T,H]`` (vLLM's
        ``precompute_and_store_context_kv`` input)."""
        return [layer.context_latent(context, positions) for layer in self.layers]

    # ---- blocks ------------------------------------------------------------------------------------------------
    def block_inputs(self, input_ids: torch.Tensor, anchors: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """``[B,A,g,H]``: slot 0 = ``embed(x_p)``, slots 1..g-1 = ``embed(mask_token_id)``."""
        g = self.config.block_size
        B, A = anchors.shape
        ids = torch.full((B, A, g), self.config.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
        ids[:, :, 0] = input_ids.gather(1, anchors)
        return embed(ids)

    def run_blocks(
        self,
        x: torch.Tensor,
        anchors: torch.Tensor,
        context: ContextKV,
        context_positions: torch.Tensor,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """The N layers and ``final_norm`` over the blocks ``x [B,a,g,H]`` of ``anchors [B,a]`` against the context
        latents ``context`` at ``context_positions [T]`` (or ``[B,T]``), ``chunk`` anchors per attention call (None:
        all at once; each block depends only on the context and itself). Layer by layer, each over every chunk."""
        B, a, g, H = x.shape
        chunk = a if chunk is None else chunk
        slot = torch.arange(g, device=x.device)
        ctx_pos = context_positions.expand(B, -1) if context_positions.dim() == 1 else context_positions
        hs, positions, allowed = [], [], []
        for start in range(0, a, chunk):
            part = anchors[:, start : start + chunk]
            n = part.shape[1]
            positions.append((part[..., None] + slot).reshape(B, n * g))
            sees_context = ctx_pos[:, None, :] < part.repeat_interleave(g, dim=1)[:, :, None]  # [B, n·g, T]
            block_of = torch.arange(n, device=x.device).repeat_interleave(g)
            own_block = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)  # [B, n·g, n·g]
            allowed.append(torch.cat([sees_context, own_block], dim=-1)[:, None])
            hs.append(x[:, start : start + chunk].reshape(B, n * g, H))
        core, kv_cache = MLA_BACKEND.resolve(self.mla_backend, x.device), check_kv_cache(self.kv_cache)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for layer, layer_context in zip(self.layers, context, strict=True):
            args = (hs, positions, allowed, layer_context, kv_cache, core)
            hs = checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        return self.final_norm(torch.cat(hs, dim=1)).view(B, a, g, H)

    def forward(
        self,
        context_features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        embed: nn.Module,
    ) -> torch.Tensor:
        """Training forward: ``context_features [B,T,n_taps·H_t]``, ``input_ids [B,T]``, ``anchors [B,A]`` (positions),
        ``keep [B,A]`` bool (real anchors), ``embed`` the frozen target embedding → the slot states after
        ``final_norm``, ``[B,A,g,H]`` (zero for ``keep`` false). Each attention call takes ``block_chunk`` anchors (each
        block depends only on the context and itself), so no ``[A·g, T + A·g]`` scores exist at once; each layer runs
        once over all chunks (an FSDP2-sharded layer is gathered once for them, not once per chunk)."""
        B, T = input_ids.shape
        if context_features.shape[:2] != (B, T):
            raise ValueError(
                f"context_features {tuple(context_features.shape)} and input_ids {tuple(input_ids.shape)} must share "
                "[B, T]"
            )
        if anchors.shape != keep.shape or anchors.dim() != 2 or anchors.shape[0] != B:
            raise ValueError(f"anchors {tuple(anchors.shape)} and keep {tuple(keep.shape)} must both be [B={B}, A]")
        anchors = torch.where(keep, anchors, torch.zeros_like(anchors))  # a padded anchor reads token 0, harmlessly
        if not anchors.is_meta and bool(((anchors < 0) | (anchors >= T)).any()):  # meta: the memory plan's census
            raise ValueError(f"anchors must be positions in [0, {T}), got values in [{anchors.min()}, {anchors.max()}]")
        positions = torch.arange(T, device=input_ids.device)
        context = self.context_kv(context_features, positions)
        out = self.run_blocks(
            self.block_inputs(input_ids, anchors, embed), anchors, context, positions, self.block_chunk
        )
        return out * keep[:, :, None, None].to(out.dtype)

    # ---- heads -------------------------------------------------------------------------------------------------
    def markov_bias(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` Markov bias of the previous tokens (teacher-forced in training)."""
        return self.markov_head.bias(prev_tokens)

    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """``hidden [..., H]``, ``prev_tokens [...]`` → confidence logits ``[...]`` fp32 (sigmoid = acceptance)."""
        if self.confidence_head is None:
            raise ValueError("this DSpark draft has no confidence head (enable_confidence_head=False)")
        return self.confidence_head(hidden, self.markov_head.embed(prev_tokens))

    @torch.no_grad()
    def sample_block(
        self,
        slot_hidden: torch.Tensor,
        anchor_tokens: torch.Tensor,
        lm_head: nn.Module,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> BlockDraft:
        """Left-to-right Markov sampling of one block per row: ``slot_hidden [B,g,H]`` (from
        :meth:`propose_block`), ``anchor_tokens [B]`` → ``g`` tokens. Slot k's logits are ``lm_head(h_k) +
        bias(x_{k-1})`` with ``x_{-1}`` the anchor; ``temperature`` 0 = greedy (argmax), else softmax(logits / T)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        prev, tokens, probs, slot_logits = anchor_tokens, [], [], []
        for k in range(slot_hidden.shape[1]):
            logits = (lm_head(slot_hidden[:, k]) + self.markov_bias(prev)).float()
            slot_logits.append(logits)
            if temperature == 0:
                prev = logits.argmax(dim=-1)
                p = F.one_hot(prev, logits.shape[-1]).float()
            else:
                p = torch.softmax(logits / temperature, dim=-1)
                prev = torch.multinomial(p, 1, generator=generator).squeeze(-1)
            tokens.append(prev)
            probs.append(p)
        return BlockDraft(torch.stack(tokens, dim=1), torch.stack(probs, dim=1), torch.stack(slot_logits, dim=1))

    @torch.no_grad()
    def propose_block(
        self,
        cache: DSparkContextCache,
        anchor_tokens: torch.Tensor,
        embed: nn.Module,
        anchor_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inference: the ``g`` slot states ``[B,g,H]`` of one block per row, anchored at ``anchor_tokens [B]`` at
        ``anchor_positions [B]`` (None: the cache length, i.e. right after the cached target states), against the
        context in ``cache``. Context keys at positions >= the anchor are not seen."""
        if cache.length == 0:
            raise ValueError("propose_block needs target states in the cache: append the prompt's states first")
        B = anchor_tokens.shape[0]
        if anchor_positions is None:
            anchor_positions = torch.full((B,), cache.length, dtype=torch.long, device=anchor_tokens.device)
        ids = torch.full((B, 1, self.config.block_size), self.config.mask_token_id, device=anchor_tokens.device)
        ids[:, 0, 0] = anchor_tokens
        positions = torch.arange(cache.length, device=anchor_tokens.device)
        return self.run_blocks(embed(ids), anchor_positions[:, None], cache.layers, positions)[:, 0]


class DSparkContextCache:
    """The drafter's context K/V cache at inference: per layer the latent and rotated ``k_pe`` of every target state
    appended so far (positions ``0..length-1``), as vLLM's per-layer latent cache holds them. :meth:`append` projects
    new target states once; :meth:`crop` drops rejected positions."""

    def __init__(self, drafter: DSparkDrafter) -> None:
        self.drafter = drafter
        self.layers: ContextKV = []
        self.length = 0

    @torch.no_grad()
    def append(self, context_features: torch.Tensor) -> None:
        """``context_features [B,t,n_taps·H_t]``: the target states of the next ``t`` positions."""
        t = context_features.shape[1]
        positions = torch.arange(self.length, self.length + t, device=context_features.device)
        new = self.drafter.context_kv(context_features, positions)
        if not self.layers:
            self.layers = new
        else:
            self.layers = [
                (torch.cat([lat, n_lat], dim=2), torch.cat([pe, n_pe], dim=2))
                for (lat, pe), (n_lat, n_pe) in zip(self.layers, new, strict=True)
            ]
        self.length += t

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (rejected draft tokens' target states are dropped)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in [0, {self.length}], got {length}")
        self.layers = [(lat[:, :, :length], pe[:, :, :length]) for lat, pe in self.layers]
        self.length = length
