"""Every top-level key a draft-training checkpoint holds besides Lightning's own, in one place, for every family.

A checkpoint says which family its draft is (:data:`DRAFT_FAMILY`, a name of
:mod:`lightning_eagle.draft.family`'s registry) and holds that family's draft config under the one shared key
:data:`DRAFT_CONFIG`; no key carries a family prefix. Checkpoints written before this layout used per-family and
``eagle_``-prefixed keys: :func:`renamed` reads them (a family's own old config key is the family record's
``legacy_config_keys``).
"""

from __future__ import annotations

from typing import Any

DRAFT_FAMILY = "draft_family"  # the family's registered name
DRAFT_CONFIG = "draft_config"  # the family's draft config, ``to_dict()``
DRAFT_TRAINING = "draft_training"  # how the draft was trained, as its export records it (EAGLE-3: ttt_steps, …)
TARGET_FINGERPRINT = "target_fingerprint"  # the target's config fingerprint a resume must match
DRAFT_SHARDED = "draft_sharded"  # model.draft.shard of the run (optimizer states are laid out by it)
DRAFT_MASTER_WEIGHTS = "draft_master_weights"  # whether the optimizer state holds fp32 masters (a 16-bit draft)
DRAFT_ORIGIN = "draft_origin"  # where a continued draft started (model.draft.init_from): path, family, target, step
RNG_STATES = "rng_states"  # rank 0's random streams, restored on resume
MICRO_BATCH_ROWS = "micro_batch_rows"  # rows one micro-batch takes over the world (cross-layout resume)

# shared keys of the layout before (old name → name now)
LEGACY_KEYS = {
    "eagle_training_settings": DRAFT_TRAINING,
    "eagle_target_fingerprint": TARGET_FINGERPRINT,
    "eagle_draft_sharded": DRAFT_SHARDED,
    "eagle_rng_states": RNG_STATES,
    "eagle_micro_batch_rows": MICRO_BATCH_ROWS,
}


def renamed(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with the shared keys of the layout before under their names now (in place; returned)."""
    for old, new in LEGACY_KEYS.items():
        if old in checkpoint and new not in checkpoint:
            checkpoint[new] = checkpoint.pop(old)
    return checkpoint
