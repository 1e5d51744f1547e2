"""One K3 decoder layer (KDA or MLA token mixer; dense or MoE channel mixer) on the AttnRes residual stream."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch
from torch import nn

from lightning_eagle.k3.attn_res import attn_res_mix, res_weights
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.kda import KimiDeltaAttention
from lightning_eagle.k3.moe import K3SparseMoE
from lightning_eagle.k3.token_chunks import TokenSegments, segment_token_mixer
from lightning_eagle.ops.mla import NoPEMLA
from lightning_eagle.ops.norm import K3RMSNorm
from lightning_eagle.ops.situ import SituMLP

MLA_LATENT_NORM_EPS = 1e-6  # the reference builds q_a/kv_a layernorms without an eps argument


def build_mla(config: KimiK3TextConfig) -> NoPEMLA:
    H = config.hidden_size
    return NoPEMLA.from_config(config, input_size=H, output_size=H, latent_norm_eps=MLA_LATENT_NORM_EPS)


class K3DecoderLayer(nn.Module):
    """Returns ``(p, bank)`` where ``p`` is the raw in-block prefix (sum of sub-layer outputs since the last
    commit) — that is what EAGLE-3 hooks on ``layers[i]`` capture.

    Built with every fast path on ``"auto"``; :func:`lightning_eagle.k3.model.set_backends` switches them."""

    def __init__(
        self,
        config: KimiK3TextConfig,
        layer_idx: int,
        expert_range: tuple[int, int] | None = None,
        expert_storage: str = "dequantized",
    ) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda(layer_idx)
        self.block_size = config.attn_res_block_size
        self.input_layernorm = K3RMSNorm(H, eps=eps)
        self.post_attention_layernorm = K3RMSNorm(H, eps=eps)
        self.self_attn = KimiDeltaAttention(config) if self.is_kda else build_mla(config)
        betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
        if config.is_moe(layer_idx):
            self.block_sparse_moe = K3SparseMoE(config, expert_range, expert_storage)
        else:
            self.mlp = SituMLP(H, config.intermediate_size, *betas)
        if self.block_size is not None:
            self.self_attention_res_norm, self.self_attention_res_proj = res_weights(H, eps)
            self.mlp_res_norm, self.mlp_res_proj = res_weights(H, eps)

    @property
    def channel_mixer(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def token_mixer(self, x: torch.Tensor, attn_mask: torch.Tensor | None, token_mask: torch.Tensor | None):
        """The full-sequence token mixer (no cache)."""
        return self.self_attn(x, token_mask) if self.is_kda else self.self_attn(x, attn_mask)

    def forward(
        self,
        p: torch.Tensor,
        bank: list[torch.Tensor],
        attn_mask: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        token_mixer: Callable[[torch.Tensor], torch.Tensor] | None = None,
        segments: TokenSegments | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``token_mixer``: ``x ↦ self_attn(x)`` in another form (incremental decoding passes one that continues
        from a cache); None = :meth:`token_mixer` over the whole sequence with the masks.

        ``segments``: run the layer segment by segment (:mod:`lightning_eagle.k3.token_chunks`; ``token_mask`` is
        then the binary ``[B,T]`` mask or None, ``attn_mask`` and ``token_mixer`` unused). One call either way, so
        forward hooks (aux taps, FSDP2 gathers) fire once per layer."""
        if segments is not None:
            return self._forward_segments(p, bank, token_mask, segments)
        if token_mixer is None:
            token_mixer = partial(self.token_mixer, attn_mask=attn_mask, token_mask=token_mask)
        return self._mix(p, bank, token_mixer)

    def _mix(
        self, p: torch.Tensor, bank: list[torch.Tensor], token_mixer: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.block_size is None:  # plain pre-norm residual stream
            h = p + token_mixer(self.input_layernorm(p))
            return h + self.channel_mixer(self.post_attention_layernorm(h)), bank
        a_in = p if not bank else attn_res_mix(p, bank, self.self_attention_res_norm, self.self_attention_res_proj)
        commit = self.layer_idx % self.block_size == 0
        if commit:
            bank = [*bank, p]
        att = token_mixer(self.input_layernorm(a_in))
        p = att if commit else p + att
        m_in = attn_res_mix(p, bank, self.mlp_res_norm, self.mlp_res_proj)
        p = p + self.channel_mixer(self.post_attention_layernorm(m_in))
        return p, bank

    def _forward_segments(
        self, p: torch.Tensor, bank: list[torch.Tensor], token_mask: torch.Tensor | None, segments: TokenSegments
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`_mix` per segment into one ``[B,T,H]`` output; the token mixer carries its state across them."""
        mixer = segment_token_mixer(self.self_attn, p.shape[1], token_mask)
        moe = getattr(self, "block_sparse_moe", None)
        out = None
        # MXFP4 experts decoded once for all segments of the layer, not once per segment.
        with moe.experts.decoded_once() if moe is not None else nullcontext():
            for start, stop in segments.bounds:
                if start == stop:
                    if moe is not None:
                        # An empty segment (another EP rank holds more tokens): the MoE exchange runs, on 0 tokens.
                        moe(p[:, start:stop])
                    continue
                part, _ = self._mix(
                    p[:, start:stop], [b[:, start:stop] for b in bank], partial(mixer, start=start, stop=stop)
                )
                if out is None:
                    out = part.new_empty(p.shape[0], p.shape[1], part.shape[-1])
                out[:, start:stop] = part
        if out is None:  # no tokens at all
            out = torch.empty_like(p)
        commit = self.block_size is not None and self.layer_idx % self.block_size == 0
        return out, ([*bank, p] if commit else bank)
