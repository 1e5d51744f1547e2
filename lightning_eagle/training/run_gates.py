"""What every draft-training module's ``setup`` refuses about the run it is in, before any weight is read: a
precision that would cast the whole module, features from another target or taps (or features handed to an online
run), and ``model.draft.shard`` without ranks to shard over. A family adds its own refusals in its module's
``refuse_unsupported_run`` (e.g. what its draft sequence parallelism does not support)."""

from __future__ import annotations

from lightning_eagle.parallel.layout import draft_mesh
from lightning_eagle.training.data_contract import features_manifest
from lightning_eagle.training.target_source import check_features_manifest


def refuse_unsupported_target_run(module) -> None:
    """What both draft families refuse: a precision that casts the whole module, features from another target or
    taps (or features handed to an online run)."""
    trainer = module.trainer
    precision = str(getattr(trainer, "precision", "32-true"))
    if precision in ("bf16-true", "16-true"):
        raise ValueError(
            f"trainer precision {precision!r} would cast the whole module, destroying the target's fp32 "
            "parameters and MXFP4 scales; use precision='32-true' with model.draft.dtype='bfloat16', or 'bf16-mixed'"
        )
    check_features_manifest(features_manifest(trainer), module.target_settings, module.target_spec)


def refuse_unshardable_draft(module) -> None:
    """``model.draft.shard`` without ranks to shard over (one rank, a strategy with no draft mesh), refused by name
    (both families; last, after the refusals that name a combination)."""
    if module.draft_settings.shard:
        draft_mesh(module.trainer)
