"""The typed run settings: each value checked once where it is made (messages name the YAML key), the flat shape
refused with each key's new place, and one set of consumers — the memory plan plans a config's defaults exactly as
``fit`` builds and runs them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from lightning_eagle import backends
from lightning_eagle.commands.cli import main, make_cli
from lightning_eagle.commands.memory_plan import run_config_from_yaml
from lightning_eagle.planning import build_plan
from lightning_eagle.planning.eagle3_unroll_forward import ttt_attention_backend
from lightning_eagle.run_settings import (
    FLAT_MODEL_KEYS,
    DraftSettings,
    ObjectiveSettings,
    OptimizationSettings,
    TargetSettings,
    as_settings,
    refuse_flat_model_keys,
)

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "lightning_eagle" / "configs" / "quickstart.yaml"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TargetSettings(dtype="float8"), "model.target.dtype must be one of 'float32', 'bfloat16', 'float16'"),
        (lambda: TargetSettings(source="remote"), "model.target.source must be one of 'online', 'features'"),
        (lambda: TargetSettings(token_chunk=0), "model.target.token_chunk must be a positive int"),
        (lambda: TargetSettings(path=""), "model.target.path must be a checkpoint folder"),
        (lambda: DraftSettings(attention_backend="nope"), "model.draft.attention_backend: unknown TTT attention"),
        (lambda: DraftSettings(kv_cache="paged"), "model.draft.kv_cache must be one of"),
        (lambda: DraftSettings(init_seed=-1), "model.draft.init_seed must be an integer >= 0"),
        (lambda: DraftSettings(shard="yes"), "model.draft.shard must be true or false"),
        (lambda: DraftSettings(config={"ttt_steps": 3}), "model.draft.config.ttt_steps: set model.objective.ttt_steps"),
        (lambda: ObjectiveSettings(ttt_steps=0), "model.objective.ttt_steps must be an integer > 0, got 0"),
        (lambda: ObjectiveSettings(step_decay=1.5), r"model.objective.step_decay must be in \(0, 1\]"),
        (lambda: ObjectiveSettings(loss_backend="fast"), "model.objective.loss_backend: unknown TTT loss backend"),
        (lambda: ObjectiveSettings(loss_chunk=0), "model.objective.loss_chunk must be an integer > 0"),
        (lambda: OptimizationSettings(lr=-1.0), "model.optimization.lr must be > 0"),
        (lambda: OptimizationSettings(warmup_ratio=1.0), r"model.optimization.warmup_ratio must be in \[0, 1\)"),
    ],
)
def test_each_setting_is_checked_where_it_is_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_registered_attention_backend_is_a_valid_setting(monkeypatch):
    from lightning_eagle.draft.ttt_attention import _KERNELS, eager_ttt_attention, register_ttt_attention

    monkeypatch.setattr(backends, "TTT_ATTENTION_BACKEND", backends.TTT_ATTENTION_BACKEND)
    monkeypatch.setitem(_KERNELS, "mine", eager_ttt_attention)
    with pytest.raises(ValueError, match="attention_backend"):
        DraftSettings(attention_backend="mine")
    register_ttt_attention("mine", eager_ttt_attention)
    assert DraftSettings(attention_backend="mine").attention_backend == "mine"


def test_settings_are_frozen_and_hashable():
    settings = DraftSettings(config={"intermediate_size": 64})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.shard = True
    assert hash(settings) == hash(DraftSettings(config={"intermediate_size": 64}))
    assert TargetSettings(aux_layer_ids=[1, 3, 5]).aux_layer_ids == (1, 3, 5)


# ---- the flat shape, refused by name ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key", sorted(FLAT_MODEL_KEYS))
def test_every_flat_key_names_its_new_place(key):
    with pytest.raises(ValueError, match=rf"run.yaml: model\.{key} is now {FLAT_MODEL_KEYS[key]}"):
        refuse_flat_model_keys({key: 1}, "run.yaml")


def test_a_flat_target_or_draft_names_its_group():
    with pytest.raises(ValueError, match="model.target is a group now: write model.target.path: quickstart"):
        refuse_flat_model_keys({"target": "quickstart"}, "x")
    with pytest.raises(ValueError, match="model.draft.intermediate_size is now model.draft.config.intermediate_size"):
        refuse_flat_model_keys({"draft": {"intermediate_size": 64}}, "x")
    refuse_flat_model_keys({"target": {"path": "quickstart"}, "draft": {"config": {"intermediate_size": 64}}}, "x")


def test_a_checkpoint_written_before_a_rename_is_read_under_the_new_name():
    from lightning_eagle.commands.cli import refuse_flat_settings

    assert as_settings("draft", {"ttt_kv_cache": "latent"}).kv_cache == "latent"
    dspark = str(REPO / "configs" / "quickstart_dspark.yaml")
    with pytest.raises(ValueError, match="model.draft.kv_form is now model.draft.kv_cache"):
        refuse_flat_settings(["--config", dspark, "--model.draft.kv_form", "latent"])
    refuse_flat_settings(["--config", dspark, "--model.draft.kv_cache", "latent"])


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--model.ttt_steps", "3"], "the command line: model.ttt_steps is now model.objective.ttt_steps"),
        (["--model.lr=1"], "model.lr is now model.optimization.lr"),
        (["--model.draft.intermediate_size", "8"], "model.draft.intermediate_size is now model.draft.config"),
        (["--model.target", "quickstart"], "model.target is a group now"),
        # one name per concept: both families' K/V cache is model.draft.kv_cache
        (["--model.draft.ttt_kv_cache", "latent"], "model.draft.ttt_kv_cache is now model.draft.kv_cache"),
    ],
)
def test_the_cli_refuses_flat_options_by_name(capsys, words, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(QUICKSTART), *words])
    assert exit_info.value.code == 1 and message in capsys.readouterr().err


def test_the_cli_refuses_a_flat_config_file(capsys, tmp_path):
    config = yaml.safe_load(QUICKSTART.read_text())
    config["model"] = {"target": "quickstart", "ttt_steps": 3}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(path)])
    assert f"error: {path}: model.ttt_steps is now model.objective.ttt_steps" in capsys.readouterr().err


# ---- one set of consumers --------------------------------------------------------------------------------------------
def _defaults_config(tmp_path: Path) -> Path:
    """The quickstart relying on the module's defaults for every backend (``auto`` attention, ``auto`` loss)."""
    config = yaml.safe_load(QUICKSTART.read_text())
    del config["model"]["draft"]["attention_backend"]
    config["model"]["objective"]["loss_backend"] = "auto"
    path = tmp_path / "defaults.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_plan_plans_what_fit_builds_and_runs(tmp_path):
    path = _defaults_config(tmp_path)
    cli = make_cli(["--config", str(path), "--trainer.default_root_dir", str(tmp_path)], False, run=False)
    module, inputs = cli.model, run_config_from_yaml(path, device="cpu").inputs
    assert inputs.draft_settings == module.draft_settings and inputs.objective == module.objective
    assert inputs.target_settings == dataclasses.replace(module.target_settings, aux_layer_ids=(1, 3, 5))
    assert inputs.draft.to_dict() == module._build_draft(320).config.to_dict()
    # `auto` resolved by the registries fit dispatches with, on the planned device
    assert ttt_attention_backend(inputs) == backends.TTT_ATTENTION_BACKEND.resolve("auto", torch.device("cpu"))
    assert inputs.loss_backend == backends.LOSS_BACKEND.resolve("auto", torch.device("cpu")) == "chunked"
    assert build_plan(inputs).peak_bytes > 0


def test_auto_on_the_planned_gpus_is_planned(tmp_path):
    """On CUDA ``auto`` is ``flex_attention`` (Triton on the planned GPUs) or ``sdpa_mask``: both planned, the
    latter with its ``[B,1,T,(k+1)T]`` mask and bias."""
    config = yaml.safe_load((REPO / "lightning_eagle" / "configs" / "kimi_k3_eagle3.yaml").read_text())
    del config["model"]["draft"]["attention_backend"]
    path = tmp_path / "k3.yaml"
    path.write_text(yaml.safe_dump(config))
    inputs = run_config_from_yaml(path, target_config="k3").inputs
    assert ttt_attention_backend(inputs) == "flex_attention"
    flex = build_plan(inputs)
    sdpa = build_plan(dataclasses.replace(inputs, flex_available=False))
    flash = build_plan(dataclasses.replace(inputs, draft_settings=DraftSettings(**{
        **dataclasses.asdict(inputs.draft_settings), "attention_backend": "flash_lse"})))  # fmt: skip
    assert flash.peak_bytes < flex.peak_bytes < sdpa.peak_bytes < 80e9
