"""Decoding settings, typed and validated once where they are made: what an acceptance run decodes with.

```python
decoding = DecodingSettings(max_new_tokens=32, num_draft_tokens=None, temperature=1.0, top_p=0.95)
report = evaluate_acceptance(target, draft, prompts, decoding)
```

:func:`~lightning_eagle.inference.acceptance.evaluate_acceptance` and
:func:`~lightning_eagle.inference.prompt_set_run.evaluate_prompt_set` take one :class:`DecodingSettings` whole; the
:class:`~lightning_eagle.inference.callback.AcceptanceCallback` makes its own from its (YAML) init args when it is
made, and the ``acceptance`` command from its flags. Its ``__post_init__`` is the one check of the values (messages
name the field); what needs the draft or the target (K against a DSpark drafter's block, taps against the target's
depth) is checked by the family's loop. :meth:`DecodingSettings.for_draft` fills in the draft family's own K where
the draft is known; :meth:`DecodingSettings.run` and :meth:`DecodingSettings.run_plain` are the one place the
settings become a loop's arguments (the loops keep their own signatures:
:func:`~lightning_eagle.inference.speculative_generate`, the families' ``generate``,
:func:`~lightning_eagle.inference.plain_generate`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lightning_eagle.aux_layers import validate_aux_layer_ids
from lightning_eagle.inference.decoding_family import default_num_draft_tokens
from lightning_eagle.inference.incremental_target import DEFAULT_PREFILL_CHUNK, check_prefill_chunk
from lightning_eagle.inference.plain import PlainOutput, plain_generate
from lightning_eagle.inference.sampling import check_top_p
from lightning_eagle.inference.speculative import SpeculativeOutput
from lightning_eagle.settings import check_positive_int_or_none, check_settings


@dataclass(frozen=True)
class DecodingSettings:
    """How every prompt of an acceptance run is decoded (defaults: greedy, the draft family's own K, 64 new tokens,
    prefill in chunks of 2048).

    ``max_new_tokens``: tokens generated per prompt (or turn); ``num_draft_tokens``: K, tokens drafted per
    verification round (None: the draft family's own, :meth:`for_draft`: an EAGLE-3 export's recorded
    ``ttt_steps``, a DSpark drafter's block); ``temperature`` (0 = greedy) and ``top_p`` (the nucleus of target and
    draft at temperature > 0; 1 = off); ``seed``: prompt i of a run is seeded ``seed + i``; ``aux_layer_ids``: the
    target taps (None: what the draft records; a DSpark drafter taps only its own); ``prefill_chunk``: prompt tokens
    per prefill forward (None: the whole prompt in one forward).
    """

    max_new_tokens: int = 64
    num_draft_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    aux_layer_ids: tuple[int, ...] | None = None
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK

    def __post_init__(self) -> None:
        if isinstance(self.temperature, float) and not math.isfinite(self.temperature):  # not "must be >= 0"
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        check_settings("", {
            "max_new_tokens": (self.max_new_tokens, "non_negative", int),
            "temperature": (self.temperature, "non_negative", float),
            "seed": (self.seed, "non_negative", int),
        })  # fmt: skip
        check_positive_int_or_none(
            "num_draft_tokens", self.num_draft_tokens, "tokens drafted per round", "the draft family's own K"
        )
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "top_p", check_top_p(self.top_p))
        check_prefill_chunk(self.prefill_chunk)
        if self.aux_layer_ids is not None:
            if isinstance(self.aux_layer_ids, (str, bytes)) or not isinstance(self.aux_layer_ids, Iterable):
                raise ValueError(
                    f"aux_layer_ids must be a list of target layer ids or None, got {self.aux_layer_ids!r}"
                )
            # the target's depth and the draft's number of taps are checked by the loop, where both are known
            object.__setattr__(self, "aux_layer_ids", tuple(validate_aux_layer_ids(self.aux_layer_ids, None, None)))

    def for_draft(self, draft: Any) -> DecodingSettings:
        """These settings with K filled in for ``draft``: ``num_draft_tokens`` as given, or (None) the K the draft's
        family drafts per verify (:func:`~lightning_eagle.inference.decoding_family.default_num_draft_tokens`)."""
        if self.num_draft_tokens is not None:
            return self
        K = default_num_draft_tokens(draft)
        if K is None:
            raise ValueError(
                f"num_draft_tokens=None drafts the draft family's own K, but no draft family claims "
                f"{type(draft).__name__}; pass num_draft_tokens"
            )
        return dataclasses.replace(self, num_draft_tokens=K)

    def run(
        self, generate: Callable[..., SpeculativeOutput], target, draft, prompt_ids, index: int = 0, stop_token_ids=None
    ) -> SpeculativeOutput:
        """Prompt ``index`` of a run decoded by ``generate`` (a family's loop, with
        :func:`~lightning_eagle.inference.speculative_generate`'s signature), seeded ``seed + index``."""
        aux = None if self.aux_layer_ids is None else list(self.aux_layer_ids)
        return generate(target, draft, prompt_ids, self.max_new_tokens, self.num_draft_tokens, self.temperature,
                        self.seed + index, aux, stop_token_ids=stop_token_ids, prefill_chunk=self.prefill_chunk,
                        top_p=self.top_p)  # fmt: skip

    def run_plain(self, target, prompt_ids, index: int = 0, stop_token_ids=None) -> PlainOutput:
        """Prompt ``index`` decoded by the target alone (:func:`~lightning_eagle.inference.plain_generate`), seeded
        as :meth:`run` seeds it: the baseline of the same settings."""
        return plain_generate(target, prompt_ids, self.max_new_tokens, self.temperature, self.seed + index,
                              stop_token_ids=stop_token_ids, prefill_chunk=self.prefill_chunk,
                              top_p=self.top_p)  # fmt: skip


def check_decoding(decoding: object, owner: str) -> DecodingSettings:
    """``decoding`` if it is a :class:`DecodingSettings`, else a ``TypeError`` naming ``owner`` and what to pass."""
    if not isinstance(decoding, DecodingSettings):
        raise TypeError(
            f"{owner}: decoding must be a DecodingSettings (e.g. DecodingSettings(max_new_tokens=32, "
            f"num_draft_tokens=3)), got {type(decoding).__name__}"
        )
    return decoding


# evaluate_acceptance's decoding when none is given (the field defaults: greedy, the family's own K, 64 new tokens)
DEFAULT_DECODING = DecodingSettings()
# The draft cards' sampling (temperature 1, top-p 0.95): what a standard prompt set is decoded with by default.
CARD_DECODING = DecodingSettings(temperature=1.0, top_p=0.95)
