"""Which target features feed the draft at inference: aux layer ids and stream, checked against target and draft.

Training and serving must tap the same features (`k3_target.md` §6.3). Resolution of ``aux_layer_ids=None``:

1. the ids recorded in the draft's config (our export records them; validated against the target's depth);
2. else (a draft imported from a reference export records none) the target's default ``[1, L//2−1, L−4]``;
3. else — shallow targets have no valid default — a ``ValueError`` that says what to pass.

The stream is the draft's recorded ``aux_hidden_state_stream`` (``"prefix"`` when it records none).

A DSpark block drafter always records its taps (``target_layer_ids``, required by vLLM) and stream:
:func:`resolve_block_taps` checks them, and the widths, against the target.
"""

from __future__ import annotations

from lightning_eagle.aux_layers import resolve_aux_layer_ids, validate_aux_layer_ids
from lightning_eagle.draft.dspark_config import check_target_layer_ids


def resolve_inference_aux(target, draft_config, aux_layer_ids: list[int] | None = None) -> tuple[list[int], str]:
    """``(aux_layer_ids, aux_stream)`` for running ``draft_config``'s draft on ``target``; raises ``ValueError``."""
    L = target.config.num_hidden_layers
    stream = getattr(draft_config, "aux_hidden_state_stream", None) or "prefix"
    if aux_layer_ids is not None:
        return validate_aux_layer_ids(list(aux_layer_ids), L), stream
    recorded = getattr(draft_config, "aux_layer_ids", None)
    if recorded is not None:
        trained_for = getattr(draft_config, "target_num_hidden_layers", None)
        if trained_for is not None and trained_for != L:
            raise ValueError(
                f"the draft records aux_layer_ids {list(recorded)} of a {trained_for}-layer target, but this target "
                f"has {L} layers; pass aux_layer_ids explicitly if you really mean to run it on this target"
            )
        try:
            return validate_aux_layer_ids(list(recorded), L), stream
        except ValueError as err:
            raise ValueError(f"the draft's recorded aux_layer_ids do not fit this target: {err}") from None
    try:
        return resolve_aux_layer_ids(None, L), stream
    except ValueError as err:
        raise ValueError(
            "the draft records no aux_layer_ids (e.g. it was imported from a reference export) and the target's "
            f"default cannot be used: {err}"
        ) from None


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


def resolve_block_taps(target, config) -> tuple[list[int], str]:
    """``(target_layer_ids, aux_stream)`` of a DSpark drafter's ``config``
    (:class:`~lightning_eagle.draft.dspark_config.DSparkDraftConfig`) on ``target``, after checking what must agree
    before any block is drafted; raises ``ValueError`` naming the mismatch."""
    tc, L = target.config, target.config.num_hidden_layers
    if config.vocab_size != tc.vocab_size:
        raise ValueError(
            f"DSpark drafter vocab_size {config.vocab_size} != target vocab_size {tc.vocab_size} (the drafter uses the "
            "target's embedding and lm_head)"
        )
    if config.target_hidden_size != tc.hidden_size:
        raise ValueError(
            f"DSpark drafter target_hidden_size {config.target_hidden_size} != target hidden_size {tc.hidden_size}"
        )
    trained_for = config.target_num_hidden_layers
    if trained_for is not None and trained_for != L:
        raise ValueError(
            f"the DSpark drafter was built for a {trained_for}-layer target (target_layer_ids "
            f"{list(config.target_layer_ids)}), but this target has {L} layers"
        )
    return check_target_layer_ids(config.target_layer_ids, L), config.aux_hidden_state_stream
