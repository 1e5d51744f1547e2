"""Keyword sets for the LightningModule / CLI tests (small enough for 2 CPU cores)."""

from __future__ import annotations

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


def module_kwargs(target_dir, **overrides):
    values = {
        "target": str(target_dir),
        "aux_layer_ids": [1, 3, 5],
        "target_dtype": "float32",
        "ttt_steps": 3,
        "lr": 1e-3,
        "draft": {"intermediate_size": 64},
    }
    values.update(overrides)
    return values


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
