"""What a draft-training checkpoint holds and what a resume refuses (every family).

A checkpoint holds the draft (with its vocabulary map where the family has one), the family's name and its draft
config under the shared keys of :mod:`lightning_eagle.checkpoint_keys` (:func:`draft_record`), the target's
fingerprint, whether the draft was FSDP2-sharded and rank 0's random streams — never the target. A resume refuses a
checkpoint of another family, target, draft architecture, vocabulary map or draft sharding, naming both values.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states

from lightning_eagle import checkpoint_keys as keys
from lightning_eagle.aux_layers import renamed_fields
from lightning_eagle.draft.family import checkpoint_family
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.training.resume import rng_states_to_checkpoint

NOT_CHECKPOINTED = ("source.", "train_metrics.", "val_metrics.")  # the target (or its teacher head) and metrics


def draft_only(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``state`` without the target and the metrics."""
    drop = tuple(prefix + name for name in NOT_CHECKPOINTED)
    return {k: v for k, v in state.items() if not k.startswith(drop)}


def draft_state(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The draft's tensors of a module state dict (keys without ``draft.``); any key of something else is refused."""
    foreign = [k for k in state_dict if not k.startswith(("draft.", "train_metrics.", "val_metrics."))]
    if foreign:
        raise KeyError(f"checkpoint holds keys that are not the draft's: {foreign[:5]}")
    return {k[len("draft.") :]: v for k, v in state_dict.items() if k.startswith("draft.")}


def check_vocab_map(saved_d2t: torch.Tensor | None, mapping) -> None:
    """The checkpoint's ``d2t`` must be the data module's (the draft's lm_head rows mean those tokens)."""
    if mapping is None or saved_d2t is None:
        return
    saved = saved_d2t.cpu()
    if saved.shape != mapping.d2t.shape or not torch.equal(saved, mapping.d2t.cpu()):
        raise ValueError(
            "the checkpoint's draft vocabulary map (d2t) differs from the data module's: the draft's lm_head rows "
            "would mean other tokens. Use the same data/tokenizer/draft_vocab_size, or start a fresh run"
        )


def load_draft(module, state_dict: dict[str, Any], mapping, assign: bool = False):
    """Load a module state dict into ``module``'s draft, strictly, after checking its vocabulary map against the data
    module's. Before ``configure_model`` (e.g. the fork/spawn launcher's main process) the draft is built on meta
    and every tensor, vocabulary map included, comes from the state: no random init."""
    state = draft_state(state_dict)
    check_vocab_map(state.get("d2t"), mapping)
    if module.draft is not None:
        return module.draft.load_state_dict(state, strict=True, assign=assign)
    with torch.device("meta"):
        draft = module._build_draft(int(state["d2t"].numel()))
    result = draft.load_state_dict(state, strict=True, assign=True)
    if module.draft_config.freeze_embeddings:
        draft.freeze_embeddings()
    module.draft = draft.to(dtype=DTYPES[module.draft_settings.dtype])
    return result


def draft_record(module) -> dict[str, Any]:
    """What a checkpoint records of its draft besides the tensors: the family, its config and how it was trained
    (the module's ``training_record()``, which the export writes as metadata)."""
    return {
        keys.DRAFT_FAMILY: module.family,
        keys.DRAFT_CONFIG: module.draft_config.to_dict(),
        keys.DRAFT_TRAINING: module.training_record(),
        keys.DRAFT_ORIGIN: module.draft_origin,
    }


def checkpoint_extras(module, micro_batch_rows: int | None) -> dict[str, Any]:
    """What ``on_save_checkpoint`` adds besides the state dict and the family's record of its draft."""
    return {
        keys.TARGET_FINGERPRINT: module.target_spec.fingerprint,
        keys.MICRO_BATCH_ROWS: micro_batch_rows,
        keys.DRAFT_SHARDED: module.draft_settings.shard,
        keys.DRAFT_MASTER_WEIGHTS: module.draft_settings.master_copy,
        # Rank 0's generators (the only checkpoint written): resumed ranks continue from the same random streams.
        keys.RNG_STATES: rng_states_to_checkpoint(_collect_rng_states(include_cuda=torch.cuda.is_available())),
    }


def check_resume(module, checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint of another family, target, draft architecture or sharding (its keys are brought to the
    shared layout first: :func:`~lightning_eagle.draft.family.checkpoint_family`)."""
    family = checkpoint_family(checkpoint)
    if family.name != module.family:
        raise ValueError(
            f"the checkpoint holds a {family.name} draft and this run trains a {module.family} draft "
            f"({type(module).__name__}): resume it with the model.class_path that wrote it, or start a new run"
        )
    saved = checkpoint.get(keys.TARGET_FINGERPRINT)
    if saved is not None and saved != module.target_spec.fingerprint:
        raise ValueError(
            f"the checkpoint was trained against another target (config fingerprint {saved}, this target "
            f"{module.target_spec.fingerprint} at {module.target_spec.path})"
        )
    saved_config = checkpoint.get(keys.DRAFT_CONFIG)
    saved_config = None if saved_config is None else renamed_fields(saved_config)  # an older checkpoint's field names
    refuse_another_draft(saved_config, module.draft_config.to_dict(), family.resumable_fields)
    settings = module.draft_settings
    for key, setting, ours in ((keys.DRAFT_SHARDED, "shard", settings.shard),
                               (keys.DRAFT_MASTER_WEIGHTS, "master_weights", settings.master_copy)):  # fmt: skip
        saved = checkpoint.get(key, False)
        if saved != ours:
            raise ValueError(
                f"the checkpoint was written with model.draft.{setting}={saved} and this run has "
                f"model.draft.{setting}={ours} (dtype {settings.dtype}): their optimizer states are laid out "
                f"differently; resume with the checkpoint's setting, or start from its weights with "
                f"model.draft.init_from"
            )


def refuse_another_draft(saved: dict[str, Any] | None, ours: dict[str, Any], resumable: tuple[str, ...] = ()) -> None:
    """A resume continues the checkpoint's draft: any architecture field (layer type, sizes, aux taps and stream,
    norms, …) that differs is refused with both values (loading is not strict, so a changed architecture would
    otherwise restore what fits and silently switch the run's, and its export's, layer)."""
    if saved is None:
        return
    # `resumable`: the family's fields set by the data / training settings (or that older checkpoints hold there)
    names = sorted(saved, key=lambda k: (k != "architecture", k))  # the layer type first: it explains the rest
    changed = {k: (saved[k], ours.get(k)) for k in names if k not in resumable and saved[k] != ours.get(k)}
    if changed:
        listed = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in changed.items())
        raise ValueError(
            f"the checkpoint's draft differs from this run's ({listed}): a resume cannot change the draft "
            "architecture; resume with the checkpoint's settings or start a new run (the checkpoint's export "
            "needs no resume: cli.py export CKPT DIR)"
        )
