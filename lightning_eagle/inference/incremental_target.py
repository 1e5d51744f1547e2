"""Incremental K3 target inference: prefill a prompt, extend by one or several tokens, roll back to a prefix.

:class:`IncrementalTarget` runs the target's own modules (embedding, AttnRes mixers, norms, MLP/MoE, head) and swaps
only the token mixers for their cached forms (:mod:`lightning_eagle.inference.target_cache`). Along the way it taps
the EAGLE-3 aux states with the meaning of :mod:`lightning_eagle.target.capture`:

* ``"prefix"`` id i < L: the output of decoder layer i (the raw in-block prefix under AttnRes);
* ``"mixed"`` id i < L−1: what layer i+1's attention reads (its AttnRes mix, before ``input_layernorm``);
  id L−1: the output mixer's result;
* id L (either stream): the input of the final norm, after the output mixer.

Outputs with the cache equal a full ``target.capture(...)`` over the whole sequence to fp32 rounding (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_eagle.inference.target_cache import KDALayerCache, MLALayerCache, kda_extend, mla_extend
from lightning_eagle.target.attn_res import attn_res_mix
from lightning_eagle.target.capture import AUX_STREAMS, validate_aux_layer_ids


@dataclass
class TargetStep:
    """Outputs for the tokens of one :meth:`IncrementalTarget.extend` call."""

    logits: torch.Tensor | None  # [B,T,V]
    aux_hidden_states: torch.Tensor | None  # [B,T,3H] (taps concatenated in aux_layer_ids order)
    hidden_states: torch.Tensor  # [B,T,H] post-norm final hidden


class IncrementalTarget:
    """A decoding session over a frozen :class:`~lightning_eagle.target.KimiK3ForCausalLM`.

    Args:
        model: the target (any dtype; its fp32 islands are respected because its own modules run).
        aux_layer_ids: ids to tap (validated against the target depth); None = no aux capture.
        aux_stream: ``"prefix"`` or ``"mixed"`` (must be the stream the draft was trained on).
        kda_recurrence: ``"auto"`` (chunked for long extensions, per token otherwise), ``"naive"`` or ``"chunk"``.

    Rows of a batch share one length (no padding); speculative decoding uses B = 1.
    """

    def __init__(
        self,
        model,
        aux_layer_ids: list[int] | None = None,
        aux_stream: str = "prefix",
        kda_recurrence: str = "auto",
    ) -> None:
        if aux_stream not in AUX_STREAMS:
            raise ValueError(f"aux_stream must be one of {AUX_STREAMS}, got {aux_stream!r}")
        self.model = model
        self.layers = model.model.layers
        L = len(self.layers)
        self.aux_layer_ids = None if aux_layer_ids is None else validate_aux_layer_ids(aux_layer_ids, L)
        self.aux_stream = aux_stream
        self.kda_recurrence = kda_recurrence
        self.reset()

    # ---- state ---------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.caches = [KDALayerCache() if layer.is_kda else MLALayerCache() for layer in self.layers]
        self.length = 0
        self._rollback_floor = 0  # the length before the last rollbackable extension

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def rollback(self, length: int) -> None:
        """Drop every position ``≥ length``. Only positions of the last (rollbackable) extension can be dropped."""
        if length == self.length:
            return
        if not self._rollback_floor <= length <= self.length:
            raise ValueError(
                f"cannot roll back to length {length}: the cache holds {self.length} positions and can only return "
                f"to a length in [{self._rollback_floor}, {self.length}] (the start of the last rollbackable "
                "extension; the KDA state before it is not kept)"
            )
        keep = length - self._rollback_floor
        for cache in self.caches:
            if isinstance(cache, KDALayerCache):
                cache.truncate_extension(keep)
            else:
                cache.truncate(length)
        self.length = length

    # ---- forward ---------------------------------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, return_logits: bool | str = "last") -> TargetStep:
        """Start a new sequence (resets the cache). The prefill is not rollbackable.

        ``return_logits``: ``"last"`` (default; only the last position's logits, ``[B,1,V]``), True (all) or False.
        """
        self.reset()
        return self.extend(input_ids, return_logits=return_logits, rollbackable=False)

    @torch.no_grad()
    def extend(
        self, input_ids: torch.Tensor, return_logits: bool | str = True, rollbackable: bool = True
    ) -> TargetStep:
        """Append ``input_ids [B,T]`` (or ``[T]``) and return their logits / aux states / final hidden."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        input_ids = input_ids.to(self.device)
        taps: dict[int, torch.Tensor] = {}
        wanted = set(self.aux_layer_ids or ())
        L = len(self.layers)
        p = self.model.model.embed_tokens(input_ids)
        bank: list[torch.Tensor] = []
        for i, (layer, cache) in enumerate(zip(self.layers, self.caches)):
            p, bank, a_in = self._layer(layer, cache, p, bank, rollbackable)
            if self.aux_stream == "mixed" and i - 1 in wanted and i - 1 < L - 1:
                taps[i - 1] = a_in  # what layer i's attention reads
            if self.aux_stream == "prefix" and i in wanted:
                taps[i] = p
        h = p
        if self.model.config.attn_res_block_size is not None:
            h = attn_res_mix(p, bank, self.model.model.output_attn_res_norm, self.model.model.output_attn_res_proj)
        for i in wanted:
            if i == L or (self.aux_stream == "mixed" and i == L - 1):
                taps[i] = h  # the final norm's input (after the output mixer)
        hidden = self.model.model.norm(h)
        if return_logits == "last":
            logits = self.model.lm_head(hidden[:, -1:])
        elif return_logits:
            logits = self.model.lm_head(hidden)
        else:
            logits = None
        if rollbackable:
            self._rollback_floor = self.length
        else:
            self._rollback_floor = self.length + input_ids.shape[1]
        self.length += input_ids.shape[1]
        aux = torch.cat([taps[i] for i in self.aux_layer_ids], dim=-1) if self.aux_layer_ids else None
        return TargetStep(logits=logits, aux_hidden_states=aux, hidden_states=hidden)

    def _layer(self, layer, cache, p: torch.Tensor, bank: list[torch.Tensor], rollbackable: bool):
        """``K3DecoderLayer.forward`` with the cached token mixer; also returns the attention input ``a_in``."""

        def token_mixer(x: torch.Tensor) -> torch.Tensor:
            if layer.is_kda:
                return kda_extend(layer.self_attn, x, cache, self.kda_recurrence, rollbackable)
            return mla_extend(layer.self_attn, x, cache)

        if layer.block_size is None:  # plain pre-norm residual stream
            h = p + token_mixer(layer.input_layernorm(p))
            return h + layer.channel_mixer(layer.post_attention_layernorm(h)), bank, p
        a_in = p if not bank else attn_res_mix(p, bank, layer.self_attention_res_norm, layer.self_attention_res_proj)
        commit = layer.layer_idx % layer.block_size == 0
        if commit:
            bank = [*bank, p]
        att = token_mixer(layer.input_layernorm(a_in))
        p = att if commit else p + att
        m_in = attn_res_mix(p, bank, layer.mlp_res_norm, layer.mlp_res_proj)
        p = p + layer.channel_mixer(layer.post_attention_layernorm(m_in))
        return p, bank, a_in
