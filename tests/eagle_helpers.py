"""Keyword sets for the LightningModule / CLI tests (small enough for 2 CPU cores)."""

from __future__ import annotations

from lightning_eagle.run_settings import (
    FLAT_MODEL_KEYS,
    DraftSettings,
    ObjectiveSettings,
    OptimizationSettings,
    TargetSettings,
)

SYNTHETIC_IDS = {"vocab_size": 512, "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 511}


def data_kwargs(**overrides):
    values = {
        "max_length": 160,
        "batch_size": 4,
        "thinking_effort": None,
        "draft_vocab_size": 320,
        "use_cache": False,
        "seed": 0,
    }
    values.update(overrides)
    return values


def module_kwargs(target_dir, draft=None, **overrides):
    """``Eagle3Module`` keywords for the tests' tiny target: the four settings groups, with ``overrides`` given by
    their flat names (``ttt_steps=2``, ``draft_shard=True``; :data:`~lightning_eagle.run_settings.FLAT_MODEL_KEYS`
    says which group each belongs to) and ``draft`` the draft config overrides."""
    flat = {
        "target": str(target_dir),
        "aux_layer_ids": [1, 3, 5],
        "target_dtype": "float32",
        "ttt_steps": 3,
        "lr": 1e-3,
        **overrides,
    }
    return grouped_settings(flat, {"intermediate_size": 64} if draft is None else draft)


def grouped_settings(flat: dict, draft_config: dict | None = None) -> dict:
    """Flat setting names → the module's settings groups (a test convenience; run configs are refused flat)."""
    groups = {"target": {}, "draft": {}, "objective": {}, "optimization": {}}
    for name, value in flat.items():
        if name == "target":
            groups["target"]["path"] = value
            continue
        if name in ("optimizer", "lr_scheduler"):
            groups[name] = value
            continue
        group, field = (FLAT_MODEL_KEYS | {"kv_cache": "model.draft.kv_cache"})[name].split(".")[1:]
        groups[group][field] = tuple(value) if field == "aux_layer_ids" and value is not None else value
    groups["draft"]["config"] = draft_config
    kinds = {"target": TargetSettings, "draft": DraftSettings, "objective": ObjectiveSettings,
             "optimization": OptimizationSettings}  # fmt: skip
    return {k: kinds[k](**v) if k in kinds else v for k, v in groups.items()}


def trainer_kwargs(tmp_path, **overrides):
    values = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),
        "num_sanity_val_steps": 0,
    }
    values.update(overrides)
    return values


def eagle_module(draft=None, **flat):
    """An ``Eagle3Module`` from flat setting names (``target=…, ttt_steps=2, draft={…}``): :func:`grouped_settings`."""
    from lightning_eagle import Eagle3Module

    return Eagle3Module(**grouped_settings(flat, draft))
