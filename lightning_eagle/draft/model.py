"""The K3 EAGLE-3 draft (`eagle3_training.md` §3): ``fc`` over the three aux states, one fused decoder layer over
``[input_layernorm(embed), hidden_norm(h)]`` (2H) with NoPE gated MLA and a SiTU MLP, a final norm and an
``lm_head`` over the draft vocabulary, plus the ``d2t``/``t2d`` vocab-map buffers.

Module names are the serving layout of §14 (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``embed_tokens``), so the
draft's ``state_dict`` *is* the export key set (with ``embed_tokens`` optional).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from lightning_eagle.draft.cache import TTTCache
from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.draft.ttt_attention import get_ttt_attention
from lightning_eagle.ops.mla import NoPEMLA
from lightning_eagle.ops.norm import K3RMSNorm
from lightning_eagle.ops.situ import SituMLP


class KimiK3Eagle3Layer(nn.Module):
    """The fused first layer: residual = the carried hidden ``h``; attention reads the 2H ``combined`` input."""

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = K3RMSNorm(H, eps=eps)
        self.hidden_norm = K3RMSNorm(H, eps=eps)
        # The draft's latent norms use rms_norm_eps (reference parity; the target's use 1e-6) — §3.4.
        self.self_attn = NoPEMLA.from_config(config, input_size=2 * H, output_size=H, latent_norm_eps=eps)
        self.post_attention_layernorm = K3RMSNorm(H, eps=eps)
        self.mlp = SituMLP(H, config.intermediate_size, config.activation_situ_beta, config.activation_situ_linear_beta)

    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[input_layernorm(embed) ‖ hidden_norm(h)]`` — embeddings first."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def attention(self, combined: torch.Tensor, cache: TTTCache, backend: str) -> torch.Tensor:
        """Project, append this step's K/V to the cache, attend over the cache, gate and project out."""
        attn = self.self_attn
        q, k, v = attn.project(combined)
        cache.append(k, v)
        o = get_ttt_attention(backend)(q, cache, attn.scale)  # [B,n,T,d_v]
        B, n, T, d_v = o.shape
        return attn.gate_output(o.transpose(1, 2).reshape(B, T, n * d_v), combined)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: TTTCache, backend: str) -> torch.Tensor:
        h = hidden + self.attention(self.combine(embeds, hidden), cache, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class KimiK3Eagle3Draft(nn.Module):
    """EAGLE-3 draft for a frozen K3 target. Built in fp32; cast only the draft to the training dtype (``d2t`` int64
    and ``t2d`` bool keep their dtypes through ``.to(dtype)``).

    One TTT step: ``h = draft.layer(ids, h, attention_mask, cache)``; ``z = draft.logits(h)``; the unroll lives in
    :func:`lightning_eagle.training.ttt_loss`.
    """

    def __init__(self, config: Eagle3DraftConfig, attention_backend: str = "eager") -> None:
        super().__init__()
        config.validate()  # §3.6: the draft constructor refuses GQA / non-NoPE even for a hand-edited config
        self.config = config
        H, V, N_d = config.hidden_size, config.vocab_size, config.draft_vocab_size
        weight = torch.empty(V, H)
        if weight.device.type != "meta":  # normal_ on meta goes through torch._refs, which imports dynamo (seconds)
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(V, H, _weight=weight)
        self.fc = nn.Linear(config.num_aux_hidden_states * config.target_hidden_size, H, bias=False)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                [
                    K3RMSNorm(config.target_hidden_size, eps=config.rms_norm_eps)
                    for _ in range(config.num_aux_hidden_states)
                ]
            )
        self.midlayer = KimiK3Eagle3Layer(config)
        self.norm = K3RMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, N_d, bias=False)
        # Default map: the first N_d target ids (identity when N_d == V); the vocab-map builder sets the real one.
        self.register_buffer("d2t", torch.zeros(N_d, dtype=torch.long), persistent=True)
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool), persistent=True)
        if self.t2d.device.type != "meta":  # meta: values come from the loaded state dict
            self.t2d[:N_d] = True
        self.attention_backend = attention_backend
        if config.freeze_embeddings:
            self.freeze_embeddings()

    # ---- knobs -------------------------------------------------------------------------------------------------------
    @property
    def attention_backend(self) -> str:
        return self._attention_backend

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        get_ttt_attention(name)  # validates
        self._attention_backend = name

    # ---- the four pieces of a TTT step ----------------------------------------------------------------------------
    def project(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``fc`` (+ per-chunk ``fc_norm``) over the concatenated aux states ``[B,T,3H_t]`` → ``[B,T,H]``."""
        if self.config.fc_norm:
            chunks = aux_hidden_states.chunk(self.config.num_aux_hidden_states, dim=-1)
            aux_hidden_states = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden_states.to(self.fc.weight.dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def layer(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: TTTCache,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One TTT step: appends this step's K/V to ``cache`` and returns the new (unshifted) hidden ``[B,T,H]``.

        ``position_ids`` are accepted and ignored: the draft is NoPE (§3.4). ``attention_mask`` is the ``[B,T]``
        right-padding mask, constant over the unroll (the cache refuses a change).
        """
        del position_ids
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"{type(self).__name__} does not support sequence packing: attention_mask must be the [B,T] padding "
                f"mask, got shape {tuple(attention_mask.shape)}"
            )
        cache.bind_mask(attention_mask)
        embeds = self.embed(input_ids).to(hidden.dtype)
        h = self.midlayer(embeds, hidden, cache, self.attention_backend)
        return self.norm(h) if self.config.norm_output else h

    forward = layer

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(norm(h))`` over the draft vocabulary (``lm_head(h)`` with ``norm_output``)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    # ---- embeddings and vocabulary map ------------------------------------------------------------------------------
    def freeze_embeddings(self) -> None:
        self.embed_tokens.weight.requires_grad_(False)

    @torch.no_grad()
    def copy_embeddings_from(self, weight: torch.Tensor) -> None:
        """Copy the target's ``embed_tokens.weight`` (a sharded DTensor is gathered first), cast to our dtype."""
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding has shape {tuple(weight.shape)}, the draft needs "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab_size, hidden_size)"
            )
        self.embed_tokens.weight.copy_(weight.to(device=self.embed_tokens.weight.device))

    @property
    def selected_token_ids(self) -> torch.Tensor:
        """Target id of each draft id: ``arange(N_d) + d2t`` (ascending in this library)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocab_mapping(self, selected_token_ids: torch.Tensor) -> None:
        """Install the map from the ascending target ids of the draft vocabulary (§9): ``d2t = selected − arange``,
        ``t2d[selected] = True``. ``lm_head`` row i must mean target id ``selected[i]``."""
        selected = selected_token_ids.reshape(-1).to(device=self.d2t.device, dtype=torch.long)
        validate_selected_token_ids(selected, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.copy_(selected - torch.arange(selected.numel(), device=selected.device))
        self.t2d.zero_()
        self.t2d[selected] = True

    # ---- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        target_embedding: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        attention_backend: str = "eager",
    ) -> KimiK3Eagle3Draft:
        """Load our export (``midlayer.*``) or a NeMo Automodel export (``model.layers.0.*``); see
        :func:`lightning_eagle.draft.pretrained.load_pretrained`."""
        from lightning_eagle.draft.pretrained import load_pretrained

        return load_pretrained(
            path, target_embedding=target_embedding, dtype=dtype, device=device, attention_backend=attention_backend
        )


def validate_selected_token_ids(selected: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """``selected`` must be N_d distinct, strictly ascending target ids in ``[0, V)`` (§9 step 4)."""
    if selected.dim() != 1 or selected.numel() != draft_vocab_size:
        raise ValueError(f"expected {draft_vocab_size} selected token ids, got shape {tuple(selected.shape)}")
    if selected.numel() and (selected.min() < 0 or selected.max() >= vocab_size):
        raise ValueError(f"selected token ids must lie in [0, {vocab_size})")
    if selected.numel() > 1 and not bool((selected[1:] > selected[:-1]).all()):
        raise ValueError(
            "selected token ids must be distinct and sorted ascending (lm_head row order == t2d order, §9); "
            "sort them and permute lm_head rows accordingly"
        )
