"""Incremental K3 target inference: prefill a prompt, extend by one or several tokens, roll back to a prefix.

:class:`IncrementalTarget` runs the target's own forward (``KimiK3TextModel.forward``: embedding, decoder layers,
output mixer, final norm) with each layer's token mixer continued from its cache
(:mod:`lightning_eagle.inference.target_cache`). It taps the EAGLE-3 aux states with the hooks of
:func:`lightning_eagle.k3.capture.aux_taps`, so their meaning is that of a full capture:

* ``"prefix"`` id i < L: the output of decoder layer i (the raw in-block prefix under AttnRes);
* ``"mixed"`` id i < L−1: what layer i+1's attention reads (its AttnRes mix, before ``input_layernorm``);
  id L−1: the output mixer's result;
* id L (either stream): the input of the final norm, after the output mixer.

Outputs with the cache equal a full ``target.capture(...)`` over the whole sequence to fp32 rounding (tests).

Long prompts: ``prefill(ids, chunk=C)`` runs the prompt as a prefill of its first ``C`` tokens and non-rollbackable
extensions of ``C`` tokens each (:func:`chunk_bounds`), so a layer's transients (MLA scores or masks ``[C,L]``, MoE
and KDA working sets of ``C`` tokens) are bounded by ``C``, never ``[T,T]``; the caches are the same tensors as a
single-shot prefill (``chunk=None``, the twin) to fp32 rounding.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from lightning_eagle.aux_layers import validate_aux_layer_ids
from lightning_eagle.inference.target_cache import KDALayerCache, MLALayerCache, kda_extend
from lightning_eagle.k3.capture import aux_taps, check_aux_stream, stack_taps
from lightning_eagle.k3.token_chunks import TokenSegments
from lightning_eagle.settings import check_positive_int_or_none

# Prompt tokens per prefill forward when the caller does not choose: [C,L] attention transients stay small at 64K
# (2048 x 65536 booleans per mask) while a chunk is still wide enough to keep the device busy.
DEFAULT_PREFILL_CHUNK = 2048


def check_prefill_chunk(prefill_chunk: int | None) -> int | None:
    """``prefill_chunk``: prompt tokens per prefill forward (a positive int) or None (the whole prompt at once)."""
    return check_positive_int_or_none(
        "prefill_chunk", prefill_chunk, "prompt tokens per prefill forward", "the whole prompt in one forward"
    )


def chunk_bounds(length: int, chunk: int | None) -> list[tuple[int, int]]:
    """``[start, stop)`` of each prefill forward over ``length`` tokens (one span when ``chunk`` is None)."""
    chunk = check_prefill_chunk(chunk) or max(length, 1)
    return TokenSegments(length, chunk, math.ceil(length / chunk)).bounds


@dataclass
class TargetStep:
    """Outputs for the tokens of one :meth:`IncrementalTarget.extend` call."""

    logits: torch.Tensor | None  # [B,T,V]
    aux_hidden_states: torch.Tensor | None  # [B,T,n·H] (the n taps concatenated in aux_layer_ids order)
    hidden_states: torch.Tensor  # [B,T,H] post-norm final hidden


class IncrementalTarget:
    """A decoding session over a frozen :class:`~lightning_eagle.k3.KimiK3ForCausalLM`.

    Args:
        model: the target (any dtype; its fp32 islands are respected because its own modules run).
        aux_layer_ids: ids to tap, any number (validated against the target depth); None = no aux capture.
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
        check_aux_stream(aux_stream)
        self.model = model
        self.layers = model.model.layers
        L = len(self.layers)
        # any number of taps: EAGLE-3 drafts read 3, a DSpark drafter one per target_layer_id
        self.aux_layer_ids = None if aux_layer_ids is None else validate_aux_layer_ids(aux_layer_ids, L, count=None)
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
    def prefill(
        self, input_ids: torch.Tensor, return_logits: bool | str = "last", chunk: int | None = None
    ) -> TargetStep:
        """Start a new sequence (resets the cache). The prefill is not rollbackable.

        ``return_logits``: ``"last"`` (default; only the last position's logits, ``[B,1,V]``), True (all) or False.
        ``chunk``: prompt tokens per forward (None = one forward); the outputs of the chunks are concatenated, so a
        caller that must not hold ``[B,T,n·H]`` aux states runs the chunks itself (:meth:`prefill_chunk`).
        """
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        T = input_ids.shape[1]
        if T == 0:
            raise ValueError("prefill needs at least one token")
        steps = [
            self.prefill_chunk(input_ids[:, start:stop], start, return_logits if stop == T else return_logits is True)
            for start, stop in chunk_bounds(T, chunk)
        ]
        if len(steps) == 1:
            return steps[0]
        logits = steps[-1].logits if return_logits == "last" else None
        if return_logits is True:
            logits = torch.cat([s.logits for s in steps], dim=1)
        aux = None if self.aux_layer_ids is None else torch.cat([s.aux_hidden_states for s in steps], dim=1)
        hidden = torch.cat([s.hidden_states for s in steps], dim=1)
        return TargetStep(logits=logits, aux_hidden_states=aux, hidden_states=hidden)

    def prefill_chunk(self, input_ids: torch.Tensor, start: int, return_logits: bool | str = False) -> TargetStep:
        """One forward of a chunked prefill: the prompt tokens ``start..start+T`` (``input_ids [B,T]``). ``start == 0``
        starts a new sequence (resets the cache); a later chunk must continue it (``start`` = :attr:`length`). Not
        rollbackable (no KDA snapshot is kept)."""
        if start == 0:
            self.reset()
        elif start != self.length:
            raise ValueError(f"prefill chunk starts at position {start}, but the cache holds {self.length} positions")
        return self.extend(input_ids, return_logits=return_logits, rollbackable=False)

    @torch.no_grad()
    def extend(
        self, input_ids: torch.Tensor, return_logits: bool | str = True, rollbackable: bool = True
    ) -> TargetStep:
        """Append ``input_ids [B,T]`` (or ``[T]``) and return their logits / aux states / final hidden."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        input_ids = input_ids.to(self.device)
        mixers = [
            partial(kda_extend, layer.self_attn, cache=cache, recurrence=self.kda_recurrence, rollbackable=rollbackable)
            if layer.is_kda
            else partial(layer.self_attn, cache=cache)  # NoPEMLA.forward: causal over cache + new
            for layer, cache in zip(self.layers, self.caches)
        ]
        ids = self.aux_layer_ids
        with aux_taps(self.model, ids, self.aux_stream) if ids else nullcontext({}) as taps:
            hidden = self.model.model(input_ids, token_mixers=mixers)
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
        aux = stack_taps(taps, ids) if ids else None
        return TargetStep(logits=logits, aux_hidden_states=aux, hidden_states=hidden)
