"""Which target features feed the draft at inference: aux layer ids and stream, checked against target and draft.

Training and serving must tap the same features (`k3_target.md` §6.3). Resolution of ``aux_layer_ids=None``:

1. the ids recorded in the draft's config (our export records them; validated against the target's depth);
2. else (a draft imported from a reference export records none) the target's default ``[1, L//2−1, L−4]``;
3. else — shallow targets have no valid default — a ``ValueError`` that says what to pass.

The stream is the draft's recorded ``aux_stream`` (``"prefix"`` when it records none).

A family whose drafter records its taps in another form checks them in its own decoding module (DSpark:
:func:`~lightning_eagle.inference.block_speculative.resolve_block_taps`).
"""

from __future__ import annotations

from lightning_eagle.aux_layers import resolve_aux_layer_ids, validate_aux_layer_ids


def resolve_inference_aux(
    target, draft_config, aux_layer_ids: list[int] | None = None, unrecorded_count: int | None = None
) -> tuple[list[int], str]:
    """``(aux_layer_ids, aux_stream)`` for running ``draft_config``'s draft on ``target``; raises ``ValueError``.
    ``unrecorded_count``: the number of taps of a draft that records none (a family's reference imports), which then
    reads the target's default taps; None: such a draft must be given ``aux_layer_ids``."""
    L = target.config.num_hidden_layers
    stream = getattr(draft_config, "aux_stream", None) or "prefix"
    recorded = getattr(draft_config, "aux_layer_ids", None)
    count = unrecorded_count if recorded is None else len(recorded)  # the draft's own number of taps
    if aux_layer_ids is not None:
        return validate_aux_layer_ids(list(aux_layer_ids), L, count), stream
    if recorded is not None:
        trained_for = getattr(draft_config, "target_num_hidden_layers", None)
        if trained_for is not None and trained_for != L:
            raise ValueError(
                f"the draft records aux_layer_ids {list(recorded)} of a {trained_for}-layer target, but this target "
                f"has {L} layers; pass aux_layer_ids explicitly if you really mean to run it on this target"
            )
        try:
            return validate_aux_layer_ids(list(recorded), L, count), stream
        except ValueError as err:
            raise ValueError(f"the draft's recorded aux_layer_ids do not fit this target: {err}") from None
    if unrecorded_count is None:
        raise ValueError(
            "the drafter records no aux_layer_ids; pass aux_layer_ids (the target layers it was trained on)"
        )
    try:
        return resolve_aux_layer_ids(None, L), stream
    except ValueError as err:
        raise ValueError(
            "the draft records no aux_layer_ids (e.g. it was imported from a reference export) and the target's "
            f"default cannot be used: {err}"
        ) from None
