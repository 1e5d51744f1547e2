"""What the chain decoding loop (:func:`~lightning_eagle.inference.speculative_generate`) drafts with, whatever the
family: the :class:`Drafter` protocol and its :class:`DraftProposal`. Any object with ``reset()``, ``extend(aux,
next_ids)`` and ``propose(num_tokens, temperature, generator, top_p)`` can drive the loop (``probs``: the law each
token was drawn from, its top-p nucleus included; e.g. a tree drafter would return the best chain of its tree);
a family whose draft is a model gives the loop an adapter (EAGLE-3: :class:`~lightning_eagle.inference.draft_runner.
DraftRunner`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class DraftProposal:
    """One chain of proposals for a batch of one row.

    ``tokens`` are *target* ids ``[K]`` (draft id + ``d2t[draft id]``); ``probs`` the draft's sampling distributions
    ``[K, N_d]`` over the draft vocabulary (None at temperature 0); ``draft_ids`` ``[K]``; ``logits`` ``[K, N_d]``;
    ``confidences`` ``[K]``: a confidence head's predicted acceptance of each slot (None: the draft has no head, e.g.
    EAGLE-3); the loop only records them, for the calibration the acceptance report measures
    (:mod:`~lightning_eagle.inference.calibration`).
    """

    tokens: torch.Tensor
    draft_ids: torch.Tensor
    probs: torch.Tensor | None
    logits: torch.Tensor
    confidences: torch.Tensor | None = None


class Drafter(Protocol):
    """What :func:`~lightning_eagle.inference.speculative_generate` needs from a drafter. ``selected_token_ids``
    (target id of each draft-vocabulary row) is used at temperature > 0; ``aux_layer_ids`` /
    ``aux_stream`` attributes (None allowed) say which target features ``extend`` expects."""

    selected_token_ids: torch.Tensor

    def reset(self) -> None: ...

    def extend(self, aux_hidden_states: torch.Tensor, next_ids: torch.Tensor) -> None: ...

    def propose(
        self, num_tokens: int, temperature: float, generator: torch.Generator | None, top_p: float = 1.0
    ) -> DraftProposal: ...
