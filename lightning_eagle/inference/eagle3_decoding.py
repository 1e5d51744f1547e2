"""EAGLE-3's decoding record: chain drafting (:func:`~lightning_eagle.inference.speculative_generate`) with a
:class:`~lightning_eagle.inference.draft_runner.DraftRunner` over the draft model, K = the ``ttt_steps`` the export
records it was trained with (else :data:`~lightning_eagle.inference.speculative.DEFAULT_NUM_DRAFT_TOKENS`)."""

from __future__ import annotations

from typing import Any

from lightning_eagle.draft.config import NUM_AUX_HIDDEN_STATES
from lightning_eagle.draft.export import EAGLE3
from lightning_eagle.inference.aux_ids import resolve_inference_aux
from lightning_eagle.inference.decoding_family import DecodingFamily, register_decoding_family
from lightning_eagle.inference.draft_runner import DraftRunner
from lightning_eagle.inference.speculative import DEFAULT_NUM_DRAFT_TOKENS, speculative_generate


def trained_steps(draft: Any) -> int:
    """The ``ttt_steps`` a loaded EAGLE-3 draft records (its export's metadata), else the default K."""
    training = getattr(draft, "training_settings", None) or {}
    return int(training.get("ttt_steps") or DEFAULT_NUM_DRAFT_TOKENS)


def check_draft_fits_target(target, draft) -> None:
    """Shapes that must agree before any token is drafted (a mismatch would silently draft garbage)."""
    tc, dc = target.config, draft.config
    if dc.vocab_size != tc.vocab_size:
        raise ValueError(f"draft vocab_size {dc.vocab_size} != target vocab_size {tc.vocab_size}")
    expected = dc.num_aux_hidden_states * tc.hidden_size
    if draft.fc.in_features != expected:
        raise ValueError(
            f"draft fc expects {draft.fc.in_features} aux features, the target gives "
            f"{dc.num_aux_hidden_states}×{tc.hidden_size} = {expected}"
        )


def draft_runner(target, draft, aux_layer_ids: list[int] | None):
    """``(DraftRunner, aux_layer_ids, aux_stream)`` of an EAGLE-3 draft model on ``target`` (checked first; a draft
    loaded without its frozen embedding gets the target's)."""
    check_draft_fits_target(target, draft)
    # a reference export records no taps: the target's default three (eagle3_training.md §6.1)
    ids, stream = resolve_inference_aux(target, draft.config, aux_layer_ids, unrecorded_count=NUM_AUX_HIDDEN_STATES)
    return DraftRunner(draft, target), ids, stream


register_decoding_family(DecodingFamily(EAGLE3, speculative_generate, trained_steps, draft_runner))
