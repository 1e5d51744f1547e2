"""``KimiK3ForCausalLM``: the frozen K3 text model (text-only path of the released VLM checkpoint)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from lightning_eagle.k3.attn_res import attn_res_mix, res_weights
from lightning_eagle.k3.capture import capture_hidden_states
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.experts import EXPERTS_BACKEND, RoutedExperts
from lightning_eagle.k3.fp32_parameters import is_fp32_parameter
from lightning_eagle.k3.kda import KDA_BACKEND, KimiDeltaAttention
from lightning_eagle.k3.layer import K3DecoderLayer
from lightning_eagle.k3.token_chunks import agreed_segments, check_chunked_call, check_token_chunk
from lightning_eagle.ops.mla import MLA_BACKEND, NoPEMLA, causal_allowed_mask
from lightning_eagle.ops.norm import K3RMSNorm


@dataclass
class K3Output:
    logits: torch.Tensor | None
    hidden_states: torch.Tensor  # post-norm final hidden [B,T,H]


def attention_mask_for_mla(
    attention_mask: torch.Tensor | None, T: int, device: torch.device | str
) -> torch.Tensor | None:
    """Boolean ``[B,1,T,T]`` (True = may attend): causal ∧ same document ∧ key not padding (indexed packing masks,
    values > 1, give documents); a padding query sees key 0 only. None (no mask: plain causal) for None."""
    if attention_mask is None:
        return None
    if attention_mask.max() <= 1:
        return causal_allowed_mask(attention_mask, T, device)
    docs = attention_mask.to(device)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    allowed = causal & (docs[:, None, :, None] == docs[:, None, None, :]) & (docs[:, None, None, :] != 0)
    key0 = (torch.arange(T, device=device) == 0).expand(T, T)
    return torch.where((docs != 0)[:, None, :, None], allowed, key0)


def set_backends(
    model: nn.Module,
    *,
    kda_backend: str | None = None,
    mla_backend: str | None = None,
    experts_backend: str | None = None,
) -> nn.Module:
    """Switch the fast paths of every layer of ``model`` (None = leave that one as it is); each name is checked by its
    registry before anything changes. Returns ``model``."""
    switches = [
        (KimiDeltaAttention, "backend", kda_backend, KDA_BACKEND),
        (NoPEMLA, "mla_backend", mla_backend, MLA_BACKEND),
        (RoutedExperts, "experts_backend", experts_backend, EXPERTS_BACKEND),
    ]
    switches = [(kind, attribute, registry.check(name)) for kind, attribute, name, registry in switches if name]
    for module in model.modules():
        for kind, attribute, name in switches:
            if isinstance(module, kind):
                setattr(module, attribute, name)
    return model


def set_token_chunk(model: nn.Module, token_chunk: int | None) -> nn.Module:
    """Set ``token_chunk`` (tokens per segment of the layer-major chunked forward, None = unchunked; see
    :mod:`lightning_eagle.k3.token_chunks`) on every K3 text model in ``model``. Returns ``model``."""
    token_chunk = check_token_chunk(token_chunk)
    for module in model.modules():
        if isinstance(module, KimiK3TextModel):
            module.token_chunk = token_chunk
    return model


class KimiK3TextModel(nn.Module):
    def __init__(
        self,
        config: KimiK3TextConfig,
        expert_range: tuple[int, int] | None = None,
        expert_storage: str = "dequantized",
    ) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.layers = nn.ModuleList(
            K3DecoderLayer(config, i, expert_range, expert_storage) for i in range(config.num_hidden_layers)
        )
        self.norm = K3RMSNorm(H, eps=config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm, self.output_attn_res_proj = res_weights(H, config.rms_norm_eps)
        self.token_chunk = None

    @property
    def token_chunk(self) -> int | None:
        """Tokens per segment of the chunked forward (:mod:`lightning_eagle.k3.token_chunks`); None = unchunked."""
        return self._token_chunk

    @token_chunk.setter
    def token_chunk(self, value: int | None) -> None:
        self._token_chunk = check_token_chunk(value)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_mixers: Sequence[Callable[[torch.Tensor], torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Returns the post-norm final hidden ``[B,T,H]`` (the output mixer runs before ``norm``).

        ``token_mixers``: one per layer, replacing the full-sequence token mixers (incremental decoding passes
        mixers that continue from its caches; they handle their own masking, ``attention_mask`` is then unused).
        With ``token_chunk`` set (and no ``token_mixers``) the layers run segment by segment
        (:meth:`forward_segments`)."""
        if token_mixers is None and self.token_chunk is not None:
            return self.forward_segments(input_ids, attention_mask, self.token_chunk)
        h = self.embed_tokens(input_ids)
        if token_mixers is None:
            if attention_mask is not None and bool((attention_mask == 1).all()):
                attention_mask = None  # all-ones: the unmasked fast path is exact
            attn_mask = attention_mask_for_mla(attention_mask, input_ids.shape[1], h.device)
            token_mixers = [
                partial(layer.token_mixer, attn_mask=attn_mask, token_mask=attention_mask) for layer in self.layers
            ]
        bank: list[torch.Tensor] = []
        for layer, token_mixer in zip(self.layers, token_mixers, strict=True):
            h, bank = layer(h, bank, token_mixer=token_mixer)
        return self.norm(self.output_mixer(h, bank))

    def forward_segments(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, token_chunk: int
    ) -> torch.Tensor:
        """:meth:`forward` with every layer, the output mixer and the final norm run layer-major in segments of
        ``token_chunk`` tokens (no autograd; right/left-padded binary masks only)."""
        check_chunked_call(self, attention_mask, token_chunk)
        with torch.no_grad():
            if attention_mask is not None and bool((attention_mask == 1).all()):
                attention_mask = None  # all-ones: the unmasked path, as in the unchunked forward
            h = self.embed_tokens(input_ids)
            segments = agreed_segments(self.layers, input_ids.shape[1], token_chunk, h.device)
            bank: list[torch.Tensor] = []
            for layer in self.layers:
                h, bank = layer(h, bank, token_mask=attention_mask, segments=segments)
            out = None
            for start, stop in segments.bounds:
                if start == stop:
                    continue
                part = self.norm(self.output_mixer(h[:, start:stop], [b[:, start:stop] for b in bank]))
                if out is None:
                    out = part.new_empty(h.shape[0], h.shape[1], part.shape[-1])
                out[:, start:stop] = part
            return torch.empty_like(h) if out is None else out

    def output_mixer(self, h: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        """AttnRes over the last layer's prefix and the bank (identity without AttnRes): the final norm's input."""
        if self.config.attn_res_block_size is None:
            return h
        return attn_res_mix(h, bank, self.output_attn_res_norm, self.output_attn_res_proj)


class KimiK3ForCausalLM(nn.Module):
    """The frozen K3 target. ``forward`` → logits; :meth:`capture` → EAGLE-3 aux states + final hidden.

    Build with :meth:`from_pretrained` (released checkpoint layout) or ``KimiK3ForCausalLM(config)`` + random
    :meth:`init_weights` (tests). ``expert_range=(start, n)`` holds only that contiguous slice of routed experts.
    The fast paths, each ``"auto"`` by default and switched later by :func:`set_backends`: ``kda_backend``
    (:data:`~lightning_eagle.k3.kda.KDA_BACKEND`), ``mla_backend`` (``"sdpa"`` fused kernels or ``"eager"``, the
    readable twin; :data:`~lightning_eagle.ops.mla.MLA_BACKEND`) and ``experts_backend`` (``"grouped_mm"`` or
    ``"bmm"``; :data:`~lightning_eagle.k3.experts.EXPERTS_BACKEND`). ``token_chunk`` (None, the default, or tokens
    per segment; switched later by :func:`set_token_chunk`): run every layer layer-major in token segments, so the
    forward's working set grows with the segment, not the sequence (:mod:`lightning_eagle.k3.token_chunks`; exact,
    no autograd).
    """

    def __init__(
        self,
        config: KimiK3TextConfig,
        expert_range: tuple[int, int] | None = None,
        kda_backend: str = "auto",
        expert_storage: str = "dequantized",
        mla_backend: str = "auto",
        experts_backend: str = "auto",
        token_chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.expert_range = expert_range
        self.model = KimiK3TextModel(config, expert_range, expert_storage)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        set_backends(self, kda_backend=kda_backend, mla_backend=mla_backend, experts_backend=experts_backend)
        set_token_chunk(self, token_chunk)

    # ---- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        expert_range: tuple[int, int] | None = None,
        kda_backend: str = "auto",
        expert_storage: str = "dequantized",
        mla_backend: str = "auto",
        experts_backend: str = "auto",
        shard=None,
        token_chunk: int | None = None,
    ) -> KimiK3ForCausalLM:
        """Load a released-layout checkpoint directory (outer VLM or bare text ``config.json``; single or sharded
        safetensors; MXFP4 or plain experts), or ``"quickstart"`` (the bundled tiny K3). Returns the model frozen and
        in eval mode.

        ``expert_storage="mxfp4"`` keeps routed experts MXFP4-packed in memory (each MoE layer decodes all its
        experts once per forward); ``"dequantized"`` decodes them once to ``dtype`` at load. The ``*_backend``
        settings and ``token_chunk`` as in the constructor. ``shard``: splits the meta-device model's dense weights
        before loading (see :mod:`lightning_eagle.parallel.dense_shard`); each rank then reads only its rows."""
        # Imported here: the loader reads checkpoints, which building or running a model never needs.
        from lightning_eagle.k3.loader import load_k3_checkpoint

        def build(config: KimiK3TextConfig) -> KimiK3ForCausalLM:
            return cls(
                config,
                expert_range=expert_range,
                kda_backend=kda_backend,
                expert_storage=expert_storage,
                mla_backend=mla_backend,
                experts_backend=experts_backend,
                token_chunk=token_chunk,
            )

        return load_k3_checkpoint(path, build, dtype=dtype, device=device, shard=shard)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float | None = None) -> KimiK3ForCausalLM:
        """Random weights for tests and synthetic targets (every structure active: non-zero router bias and
        AttnRes queries, decays spread over the allowed range)."""
        gen = torch.Generator().manual_seed(seed)
        std = std if std is not None else getattr(self.config, "initializer_range", 0.02)

        def normal(p: torch.Tensor, scale: float) -> None:
            p.copy_(torch.randn(p.shape, generator=gen) * scale)

        for name, p in self.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
                normal(p, 0.1)
            elif "conv1d" in name:
                normal(p, 1 / math.sqrt(p.shape[-1]))
            elif name.endswith("_res_proj.weight"):
                normal(p, 1.0 / math.sqrt(p.shape[-1]))
            elif p.dim() == 1:  # norm weights
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:
                normal(p, 1 / math.sqrt(p.shape[1]))
            else:
                normal(p, std)
        return self

    def cast_to(self, dtype: torch.dtype) -> KimiK3ForCausalLM:
        """Cast to the model dtype, keeping the spec's fp32 parameters fp32 (a whole-module ``.to(bf16)`` would
        destroy them)."""
        for name, p in self.named_parameters():
            if p.is_floating_point() and not is_fp32_parameter(name):
                p.data = p.data.to(dtype)
        return self

    def freeze(self) -> KimiK3ForCausalLM:
        self.requires_grad_(False)
        return self.eval()

    # ---- forward --------------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int | slice | None = None,
        return_logits: bool = True,
    ) -> K3Output:
        hidden = self.model(input_ids, attention_mask)
        if not return_logits:
            return K3Output(logits=None, hidden_states=hidden)
        h = hidden
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, slice):
            h = hidden[:, logits_to_keep]
        return K3Output(logits=self.lm_head(h), hidden_states=hidden)

    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        aux_layer_ids: list[int] | None = None,
        aux_stream: str = "prefix",
        return_logits: bool = False,
        return_prenorm: bool = False,
    ):
        """One no-grad forward that returns ``aux_hidden_states [B,T,3H]`` (taps concatenated in the given order),
        ``final_hidden [B,T,H]`` (post-norm) and, if asked, ``logits`` and ``final_prenorm`` (the final norm's
        input). See :mod:`lightning_eagle.k3.capture`."""
        return capture_hidden_states(
            self, input_ids, attention_mask, aux_layer_ids, aux_stream, return_logits, return_prenorm
        )
