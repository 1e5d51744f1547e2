"""EAGLE-3's decoding record: chain drafting (:func:`~lightning_eagle.inference.speculative_generate`), K = the
``ttt_steps`` the export records it was trained with (else :data:`~lightning_eagle.inference.speculative.
DEFAULT_NUM_DRAFT_TOKENS`)."""

from __future__ import annotations

from typing import Any

from lightning_eagle.draft.export import EAGLE3
from lightning_eagle.inference.draft_families import DecodingFamily, register_decoding_family
from lightning_eagle.inference.speculative import DEFAULT_NUM_DRAFT_TOKENS, speculative_generate


def trained_steps(draft: Any) -> int:
    """The ``ttt_steps`` a loaded EAGLE-3 draft records (its export's metadata), else the default K."""
    training = getattr(draft, "training_settings", None) or {}
    return int(training.get("ttt_steps") or DEFAULT_NUM_DRAFT_TOKENS)


register_decoding_family(DecodingFamily(EAGLE3, speculative_generate, trained_steps))
