"""``cli.py`` end to end on the tiny config: fit, validate, --print_config and the export subcommand."""

from pathlib import Path

import pytest
import torch
import yaml

from lightning_eagle import KimiK3Eagle3Draft
from lightning_eagle.commands.cli import main

REPO = Path(__file__).resolve().parents[2]


def _args(subcommand, target_dir, tmp_path, *extra):
    return [
        subcommand,
        "--config", str(REPO / "configs" / "quickstart.yaml"),
        "--model.target.path", str(target_dir),
        "--model.objective.ttt_steps", "2",
        "--data.max_length", "160",
        "--data.batch_size", "2",
        "--data.use_cache", "false",
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.logger", "false",
        "--trainer.callbacks", "[]",
        "--trainer.enable_progress_bar", "false",
        *extra,
    ]  # fmt: skip


def test_print_config_resolves(target_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_args("fit", target_dir, tmp_path, "--print_config"))
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["target"]["aux_layer_ids"] == [1, 3, 5]
    assert printed["trainer"]["precision"] == "32-true"
    assert printed["data"]["class_path"].endswith("ChatDataModule")  # the default data class (features: another)
    assert printed["data"]["init_args"]["draft_vocab_size"] == 320


def test_fit_validate_and_export(target_dir, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    main(
        _args(
            "fit", target_dir, tmp_path,
            "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "1",
            "--trainer.enable_checkpointing", "true",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={ckpt_dir}", "--trainer.callbacks.save_last=true",
        )
    )  # fmt: skip
    ckpt = ckpt_dir / "last.ckpt"
    assert ckpt.is_file()
    main(_args("validate", target_dir, tmp_path, "--trainer.limit_val_batches", "1", "--ckpt_path", str(ckpt)))
    main(_args("test", target_dir, tmp_path, "--trainer.limit_test_batches", "1", "--ckpt_path", str(ckpt)))
    main(_args("predict", target_dir, tmp_path, "--trainer.limit_predict_batches", "1", "--ckpt_path", str(ckpt)))
    out = tmp_path / "export"
    main(["export", str(ckpt), str(out)])
    draft = KimiK3Eagle3Draft.from_pretrained(out, target_embedding=torch.zeros(512, 128))
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert torch.equal(draft.fc.weight, state["draft.fc.weight"])
    assert torch.equal(draft.d2t, state["draft.d2t"])
    assert draft.config.aux_layer_ids == [1, 3, 5]
    with pytest.raises(SystemExit) as exit_info:  # a user error: one line on stderr, status 1
        main(["export", str(ckpt), str(out)])
    assert exit_info.value.code == 1


def test_real_k3_config_parses(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs" / "kimi_k3_eagle3.yaml"), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"].endswith("ExpertParallelStrategy")
    assert strategy["init_args"]["expert_parallel_size"] == 64
    assert printed["model"]["objective"]["ttt_steps"] == 7 and printed["data"]["init_args"]["draft_vocab_size"] == 32000
    assert printed["model"]["draft"]["dtype"] == "bfloat16" and printed["trainer"]["precision"] == "32-true"


def test_help_lists_every_subcommand_including_export(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for word in ("fit", "validate", "test", "predict", "export"):
        assert f"\n    {word} " in out, word


def test_user_error_is_one_line_with_the_fix_and_status_1(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert err.startswith("error: export source") and "--debug" in err
    assert not (tmp_path / "out").exists()


def test_step_progress_label():
    from types import SimpleNamespace

    from lightning_eagle.training.progress import StepProgressBar

    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_steps=150, global_step=20, max_epochs=-1)
    assert bar._get_train_description(0).strip() == "Epoch 0 · step 20/150"  # never "Epoch 0/-2"
    bar._trainer = SimpleNamespace(max_steps=-1, global_step=20, max_epochs=3)
    assert bar._get_train_description(1).strip() == "Epoch 1/2"
