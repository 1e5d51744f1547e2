"""``draft: {architecture: deepseek_mla}`` through the unchanged Lightning module: one fit step (TTT loss, metrics,
val/tau_sim), checkpoint restore into a fresh module, and the engine export from the checkpoint file."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import torch
from eagle_helpers import data_kwargs, module_kwargs, trainer_kwargs

from lightning_eagle import Eagle3Module
from lightning_eagle.data import ChatDataModule
from lightning_eagle.draft import export_draft
from lightning_eagle.draft.deepseek_mla import DeepseekMLAEagle3Draft


def test_fit_restore_and_export(target_dir, tmp_path):
    torch.manual_seed(0)
    draft = {"intermediate_size": 64, "architecture": "deepseek_mla", "rope_scaling": {"type": "yarn", "factor": 2,
             "original_max_position_embeddings": 64}}  # fmt: skip
    module = Eagle3Module(**module_kwargs(target_dir, draft=draft))
    assert module.draft_config.hidden_act == "silu" and module.draft_config.rope_scaling["factor"] == 2.0
    data = ChatDataModule(**data_kwargs())
    trainer = pl.Trainer(
        **trainer_kwargs(tmp_path, max_steps=1, limit_val_batches=1, val_check_interval=1, enable_checkpointing=False)
    )
    trainer.fit(module, data)
    assert type(module.draft) is DeepseekMLAEagle3Draft
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert 1.0 <= trainer.callback_metrics["val/tau_sim"] <= 1 + module.objective.ttt_steps
    ckpt = tmp_path / "one.ckpt"
    trainer.save_checkpoint(ckpt)

    fresh = Eagle3Module(**module_kwargs(target_dir, draft=draft))
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    fresh.load_state_dict(saved["state_dict"])  # builds the draft from the config: the deepseek_mla class
    assert type(fresh.draft) is DeepseekMLAEagle3Draft
    for name, value in module.draft.state_dict().items():
        assert torch.equal(fresh.draft.state_dict()[name], value), name

    out = export_draft(ckpt, tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
