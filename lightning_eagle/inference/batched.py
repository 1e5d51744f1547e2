"""Batched incremental decoding with the K3 target: several prompts per forward, left-padded, continuously refilled.

:class:`~lightning_eagle.inference.incremental_target.IncrementalTarget` decodes rows of one common length (what
speculative decoding needs, B = 1). Plain generation over many prompts wants the opposite: many rows of different
lengths in one forward. The per-layer caches make that cheap because K3 has no positional encoding (NoPE MLA) and
KDA carries a fixed-size state per row:

* **KDA** layers keep, per row, the recurrent state ``S [B,h,K,V]`` (fp32) and the short-conv tails
  ``3 × [B,W−1,D]`` — the same tensors as :class:`~lightning_eagle.inference.target_cache.KDALayerCache`, batched.
  A left-padded prefill zeroes the raw projections at padding and runs the recurrence with no decay and no write
  there (``g = 0``, ``β = 0``), exactly what the full forward does with a ``token_mask``
  (:meth:`~lightning_eagle.k3.kda.KimiDeltaAttention.forward`): the state and the tails leave the padding as
  they entered it (zero), so a padded row continues as its unpadded self.
* **MLA** layers keep keys ``[B,n,L,d_qk]`` and values ``[B,n,L,d_v]`` and one shared key mask ``valid [B,L]``
  (False at a row's left padding). A decode step appends one position to every row; rows of different lengths
  simply carry different amounts of left padding, which the mask hides. No position ids are needed (NoPE).

Rows can therefore leave the batch (a finished sequence: :meth:`BatchedState.select`) and join it (a freshly
prefilled group: :meth:`BatchedState.concat` left-pads the shorter MLA caches), which gives continuous batching in
:class:`BatchedGenerator`: the batch is refilled from the queue whenever sequences finish. Prefills and decode steps
run the target's own forward with the cached token mixers of :mod:`~lightning_eagle.inference.target_cache`
(the KDA / MLA modules continue from the batched caches), so a row decodes as in
:func:`~lightning_eagle.inference.plain.plain_generate` (identical at B = 1; at B > 1 only the matmul blocking of
the BLAS kernels may differ, i.e. fp32 rounding, tested to give the same greedy tokens on the tiny target).

Long prompts: ``prefill_chunk`` prefills a left-padded group ``C`` positions per forward (each chunk continues the
group's caches, its padding masked as in one forward), so the MLA masks are boolean ``[B,1,C,L]`` and the layers'
working sets ``C`` tokens wide; None = one forward (the twin, ``[B,1,T,T]`` masks).

Not implemented: paged / preallocated KV memory (keys are concatenated per step by ``MLALayerCache.update``) and
prefix sharing between prompts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lightning_eagle.inference.incremental_target import DEFAULT_PREFILL_CHUNK, check_prefill_chunk, chunk_bounds
from lightning_eagle.inference.sampling import check_top_p, pick_token
from lightning_eagle.inference.speculative import make_generator
from lightning_eagle.inference.target_cache import KDALayerCache, MLALayerCache, kda_extend
from lightning_eagle.ops.mla import causal_allowed_mask


# ---- caches ----------------------------------------------------------------------------------------------------------
@dataclass
class BatchedState:
    """Caches of a batch of sequences: per layer ``("kda", state, tails)`` or ``("mla", keys, values)``, plus the
    MLA key mask ``valid [B,L]`` (False at left padding) shared by all MLA layers."""

    layers: list[tuple]
    valid: torch.Tensor  # [B,L] bool

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def select(self, rows: torch.Tensor | Sequence[int]) -> BatchedState:
        """Keep ``rows`` (in that order); leading positions that are padding in every kept row are dropped."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.valid.device)
        valid = self.valid.index_select(0, rows)
        used = valid.any(0).nonzero()
        start = int(used[0]) if used.numel() else valid.shape[1]
        layers = []
        for kind, a, b in self.layers:
            if kind == "kda":
                layers.append((kind, a.index_select(0, rows), [t.index_select(0, rows) for t in b]))
            else:
                layers.append((kind, a.index_select(0, rows)[:, :, start:], b.index_select(0, rows)[:, :, start:]))
        return BatchedState(layers, valid[:, start:])

    @staticmethod
    def concat(states: Sequence[BatchedState]) -> BatchedState:
        """Stack batches of different lengths: shorter MLA caches get left padding (masked keys, zero values)."""
        states = [s for s in states if s.batch_size]
        if len(states) == 1:
            return states[0]
        L = max(s.length for s in states)

        def pad(t: torch.Tensor, s: BatchedState) -> torch.Tensor:  # [B,n,l,d] -> [B,n,L,d]
            return F.pad(t, (0, 0, L - s.length, 0))

        layers = []
        for i, (kind, _, _) in enumerate(states[0].layers):
            if kind == "kda":
                tails = [torch.cat([s.layers[i][2][j] for s in states]) for j in range(len(states[0].layers[i][2]))]
                layers.append((kind, torch.cat([s.layers[i][1] for s in states]), tails))
            else:
                keys = torch.cat([pad(s.layers[i][1], s) for s in states])
                values = torch.cat([pad(s.layers[i][2], s) for s in states])
                layers.append((kind, keys, values))
        valid = torch.cat([F.pad(s.valid, (L - s.length, 0), value=False) for s in states])
        return BatchedState(layers, valid)


def _layer_mixer(
    layer, cached: tuple | None, keep: torch.Tensor | None, mask: torch.Tensor, recurrence: str, out: list
):
    """``layer``'s token mixer continued from ``cached`` (None = a prefill; ``keep [B,T]`` False at left padding);
    appends the layer's new cache entry to ``out``."""

    def token_mixer(x: torch.Tensor) -> torch.Tensor:
        if layer.is_kda:
            cache = KDALayerCache() if cached is None else KDALayerCache(state=cached[1], tails=cached[2])
            y = kda_extend(layer.self_attn, x, cache, recurrence, rollbackable=False, token_mask=keep)
            out.append(("kda", cache.state, cache.tails))
        else:
            cache = MLALayerCache() if cached is None else MLALayerCache(cached[1], cached[2])
            y = layer.self_attn(x, mask, cache=cache)
            out.append(("mla", cache.keys, cache.values))
        return y

    return token_mixer


@torch.no_grad()
def _forward(model, input_ids: torch.Tensor, state: BatchedState | None, keep: torch.Tensor | None, recurrence: str):
    """One forward over ``input_ids [B,T]``: a prefill or one chunk of it (``keep`` the left-padding mask of these
    positions; ``state`` None for the first) or a decode step (T = 1, every row real). Returns the last position's
    logits ``[B,V]`` and the new state."""
    inner = model.model
    B, T = input_ids.shape
    device = input_ids.device
    new = torch.ones(B, T, dtype=torch.bool, device=device) if keep is None else keep
    valid = new if state is None else torch.cat([state.valid, new], dim=1)
    past = valid.shape[1] - T
    # Boolean: both MLA cores read it exactly as the additive form (sdpa as `allowed`, eager as 0 / fp32 min), at a
    # quarter of the transient.
    mask = causal_allowed_mask(None if keep is None and state is None else valid, T, device, past)
    new_layers: list[tuple] = []
    mixers = [
        _layer_mixer(layer, None if state is None else state.layers[i], keep, mask, recurrence, new_layers)
        for i, layer in enumerate(inner.layers)
    ]
    hidden = inner(input_ids, token_mixers=mixers)
    return model.lm_head(hidden[:, -1]), BatchedState(new_layers, valid)


def batched_prefill(
    model,
    prompts: Sequence[Sequence[int]],
    pad_token_id: int = 0,
    kda_recurrence: str = "auto",
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
) -> tuple[torch.Tensor, BatchedState]:
    """Prefill left-padded ``prompts``, ``prefill_chunk`` positions per forward (None = one forward); returns the
    last-position logits ``[B,V]`` and the caches."""
    check_prefill_chunk(prefill_chunk)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("batched_prefill needs at least one prompt and no empty prompt")
    device = model.lm_head.weight.device
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), int(pad_token_id), dtype=torch.long)
    keep = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, prompt in enumerate(prompts):
        ids[b, T - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        keep[b, T - len(prompt) :] = True
    ids, keep = ids.to(device), keep.to(device) if not bool(keep.all()) else None
    state = None
    for start, stop in chunk_bounds(T, prefill_chunk):
        chunk_keep = None if keep is None else keep[:, start:stop]
        logits, state = _forward(model, ids[:, start:stop], state, chunk_keep, kda_recurrence)
    return logits, state


def batched_step(
    model, state: BatchedState, tokens: torch.Tensor, kda_recurrence: str = "auto"
) -> tuple[torch.Tensor, BatchedState]:
    """Append one token per row (``tokens [B]``); returns the new logits ``[B,V]`` and caches."""
    tokens = torch.as_tensor(tokens, dtype=torch.long, device=state.valid.device).view(-1, 1)
    return _forward(model, tokens, state, None, kda_recurrence)


# ---- sampling --------------------------------------------------------------------------------------------------------
def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token from one logits row: argmax at temperature 0; else a sample from
    ``softmax(logits / temperature)`` restricted to the smallest set of tokens whose mass reaches ``top_p``
    (:func:`~lightning_eagle.inference.sampling.nucleus`; ``top_p >= 1`` is exactly
    :func:`~lightning_eagle.inference.sampling.pick_token`)."""
    if temperature <= 0 or top_p >= 1.0:
        return pick_token(logits, temperature, generator)
    return pick_token(logits, temperature, generator, check_top_p(top_p))


# ---- continuous batching ---------------------------------------------------------------------------------------------
@dataclass
class GenerationRequest:
    """One prompt to continue. ``seed`` seeds this request's own generator (None = from the global torch RNG), so a
    sampled output does not depend on which other requests share its batch."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    key: Any = None


@dataclass
class GenerationResult:
    key: Any
    tokens: list[int]  # new tokens, the stop token included when one ended the sequence
    stopped: bool  # ended on a stop token (else on max_new_tokens)
    prompt_tokens: int = 0


@dataclass
class _Active:
    request: GenerationRequest
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)


class BatchedGenerator:
    """Continuous batching over the incremental target: up to ``max_batch_size`` sequences decode together; when
    some finish, queued requests are prefilled (as one left-padded group) and join the running batch.

    ``submit`` queues requests, each ``step()`` admits what fits, runs one decode forward and returns the requests
    that finished; :meth:`generate` does it all for a list. ``stop_token_ids`` end a sequence (the stop token is
    kept in ``tokens``, as in :func:`~lightning_eagle.inference.plain.plain_generate`). ``prefill_chunk``: positions
    per prefill forward of an admitted group (None = one forward).
    """

    def __init__(
        self,
        model,
        stop_token_ids: Iterable[int] = (),
        max_batch_size: int = 8,
        pad_token_id: int | None = None,
        kda_recurrence: str = "auto",
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        self.model = model
        self.stop = {int(t) for t in stop_token_ids}
        self.max_batch_size = max_batch_size
        vocab = model.config.vocab_size
        pad = getattr(model.config, "pad_token_id", None) if pad_token_id is None else pad_token_id
        self.pad_token_id = int(pad) if pad is not None and 0 <= int(pad) < vocab else 0
        self.kda_recurrence = kda_recurrence
        self.queue: deque[GenerationRequest] = deque()
        self.active: list[_Active] = []
        self.state: BatchedState | None = None
        self.forwards = 0
        self.generated_tokens = 0
        self.seconds = 0.0

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def submit(self, request: GenerationRequest) -> None:
        if not request.prompt:
            raise ValueError(f"request {request.key!r}: empty prompt")
        self.queue.append(request)

    def __len__(self) -> int:
        """Requests not finished yet (queued or decoding)."""
        return len(self.queue) + len(self.active)

    def _pick(self, row: _Active, logits: torch.Tensor) -> int:
        r = row.request
        return sample_token(logits, r.temperature, r.top_p, row.generator)

    def _finished(self, row: _Active) -> bool:
        return len(row.tokens) >= row.request.max_new_tokens or row.tokens[-1] in self.stop

    def _result(self, row: _Active) -> GenerationResult:
        stopped = bool(row.tokens) and row.tokens[-1] in self.stop
        return GenerationResult(row.request.key, row.tokens, stopped, len(row.request.prompt))

    @torch.no_grad()
    def step(self) -> list[GenerationResult]:
        """Admit queued requests into free slots (one prefill forward), then one decode forward for the sequences
        that were already running. Returns the requests that finished in this step."""
        start = time.perf_counter()
        done: list[GenerationResult] = []
        # Decode the running rows first (their next token is known), then admit: new rows start with the prefill.
        if self.active:
            last = torch.tensor([row.tokens[-1] for row in self.active], device=self.device)
            logits, self.state = batched_step(self.model, self.state, last, self.kda_recurrence)
            self.forwards += 1
            self._advance(logits, done)
        free = self.max_batch_size - len(self.active)
        if free > 0 and self.queue:
            group: list[_Active] = []
            while self.queue and len(group) < free:
                request = self.queue.popleft()
                if request.max_new_tokens <= 0:
                    done.append(GenerationResult(request.key, [], False, len(request.prompt)))
                    continue
                gen = make_generator(request.seed, self.device) if request.temperature > 0 else None
                group.append(_Active(request, gen))
            if group:
                logits, state = batched_prefill(
                    self.model,
                    [row.request.prompt for row in group],
                    self.pad_token_id,
                    self.kda_recurrence,
                    self.prefill_chunk,
                )
                self.forwards += 1
                self.active += group
                self.state = state if self.state is None else BatchedState.concat([self.state, state])
                self._advance(logits, done, offset=len(self.active) - len(group))
        self.seconds += time.perf_counter() - start
        return done

    def _advance(self, logits: torch.Tensor, done: list[GenerationResult], offset: int = 0) -> None:
        """Pick the next token of rows ``offset..`` from ``logits``; drop the rows that finish."""
        rows = self.active[offset:]
        greedy = [i for i, row in enumerate(rows) if row.request.temperature <= 0]
        argmax = logits[greedy].argmax(-1).tolist() if greedy else []
        picks = dict(zip(greedy, argmax))
        keep: list[int] = list(range(offset))
        for i, row in enumerate(rows):
            row.tokens.append(int(picks[i]) if i in picks else self._pick(row, logits[i]))
            self.generated_tokens += 1
            if self._finished(row):
                done.append(self._result(row))
            else:
                keep.append(offset + i)
        if len(keep) < len(self.active):
            self.active = [self.active[i] for i in keep]
            self.state = self.state.select(keep) if keep else None

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` to completion; results in request order."""
        requests = list(requests)
        for i, request in enumerate(requests):
            self.submit(GenerationRequest(**{**request.__dict__, "key": i}))
        results: dict[int, GenerationResult] = {}
        while len(self):
            for result in self.step():
                results[result.key] = result
        out = []
        for i, request in enumerate(requests):
            result = results[i]
            result.key = request.key
            out.append(result)
        return out
