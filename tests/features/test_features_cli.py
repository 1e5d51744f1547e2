"""``cli.py dump`` → ``cli.py fit`` on dumped features → export, through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_eagle.commands.cli import main

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
         "--trainer.enable_progress_bar", "false"]  # fmt: skip


@pytest.mark.slow
def test_dump_then_offline_fit_and_export(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_EAGLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # the configs' relative runs/… paths land here
    main(["dump", "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.max_length", "128"])
    features = tmp_path / "runs" / "quickstart" / "features"  # the contract's default location
    manifest = json.loads((features / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["hidden_states"] == "prenorm"
    main(["fit", "--config", str(REPO / "configs" / "quickstart_offline.yaml"), *SMALL])
    out = capsys.readouterr().out
    assert "fit finished" in out and "last val/tau_real" in out
    assert (tmp_path / "runs" / "quickstart_offline" / "draft" / "model.safetensors").is_file()
    # The other features' folder is refused with the reason, through the CLI's one-line error.
    with pytest.raises(SystemExit) as exit_info:
        main(["dump", "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.max_length", "96"])
    assert exit_info.value.code == 1 and "holds a dump of other features" in capsys.readouterr().err
