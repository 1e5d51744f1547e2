"""Signals honoured at every stage of ``cli.py fit`` (issue 39, "Nothing silent"): a real SIGTERM (a scheduler's
preemption) or SIGINT (Ctrl+C) sent to a real ``cli.py fit`` on the tiny quickstart target while it loads the target,
while it validates (acceptance decoding included) and while it exports at the end exits ``128 + signal`` with one
``error:`` line saying what was interrupted and what to rerun, leaves no partial folder or half-written file, and
leaves the checkpoint the rerun needs. (The step-boundary path: ``tests/training/test_training_preemption.py``.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 4


def _config(tmp_path: Path, helper: str, signum: int, validate: bool = False) -> Path:
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config["trainer"].update(
        max_steps=MAX_STEPS,
        val_check_interval=2 if validate else 50,
        limit_val_batches=1 if validate else 0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path / "run"),
    )
    callbacks = [c for c in config["trainer"]["callbacks"] if not c["class_path"].endswith("AcceptanceCallback")]
    if validate:
        callbacks.append({"class_path": "lightning_eagle.inference.callback.AcceptanceCallback",
                          "init_args": {"num_prompts": 4, "max_new_tokens": 16}})  # fmt: skip
    marker = tmp_path / "signal-sent"
    callbacks.append({"class_path": f"signal_helpers.{helper}", "init_args": {"marker": str(marker),
                                                                              "signum": int(signum)}})  # fmt: skip
    config["trainer"]["callbacks"] = callbacks
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _cli(tmp_path: Path, *words: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
           "LIGHTNING_EAGLE_CACHE": str(tmp_path / "cache")}  # fmt: skip
    cmd = [sys.executable, str(REPO / "cli.py"), *words]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _error(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(".partial"))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl_c"])
def test_a_signal_during_the_target_load_exits_128_plus_signal_and_says_to_rerun(tmp_path, signum):
    cut = _cli(tmp_path, "fit", "--config", str(_config(tmp_path, "SignalDuringTargetLoad", signum)))
    assert cut.returncode == 128 + signum, cut.stderr[-3000:]
    assert _error(cut) == (
        f"error: fit interrupted by {signal.Signals(signum).name} before training started (loading the target, the "
        "data or the run's state, or the sanity check): nothing was trained or saved; rerun the same cli.py fit command"
    )
    root = tmp_path / "run"
    assert not (root / "checkpoints").exists() and not (root / "draft").exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_sigterm_during_acceptance_decoding_stops_at_once_saves_and_exits_143(tmp_path):
    config = _config(tmp_path, "SignalDuringAcceptance", signal.SIGTERM, validate=True)
    cut = _cli(tmp_path, "fit", "--config", str(config))
    ended = time.time()
    root = tmp_path / "run"
    ckpt = root / "checkpoints" / "last.ckpt"
    assert cut.returncode == 143, cut.stderr[-3000:]
    assert _error(cut) == (
        "error: fit stopped by SIGTERM during validation after global step 2 (the validation was cut short): a "
        f"resumable checkpoint is at {ckpt}; continue with --ckpt_path {ckpt} (nothing was exported)"
    )
    assert ended - float((tmp_path / "signal-sent").read_text()) < 20  # within a scheduler's 30 s grace
    assert torch.load(ckpt, weights_only=False)["global_step"] == 2
    assert not (root / "draft").exists() and _leftovers(tmp_path) == []

    # the checkpoint resumes: training continues after the cut validation and ends with the export
    (tmp_path / "signal-sent").unlink()
    resume = yaml.safe_load(config.read_text())  # the same run without the signal and (for time) the decoding
    resume["trainer"]["callbacks"] = [c for c in resume["trainer"]["callbacks"]
                                      if c["class_path"].startswith("lightning.")
                                      or c["class_path"].endswith("ExportDraftCallback")]  # fmt: skip
    config.write_text(yaml.safe_dump(resume))
    resumed = _cli(tmp_path, "fit", "--config", str(config), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {ckpt}" in resumed.stdout + resumed.stderr
    assert (root / "draft" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl_c"])
def test_a_signal_during_the_fit_end_export_leaves_no_partial_folder_and_names_the_export_to_rerun(tmp_path, signum):
    cut = _cli(tmp_path, "fit", "--config", str(_config(tmp_path, "SignalDuringExport", signum)))
    root = tmp_path / "run"
    assert cut.returncode == 128 + signum, cut.stderr[-3000:]
    message = _error(cut)
    found = re.fullmatch(
        rf"error: fit's export stopped by {signal.Signals(signum).name} after training ended \(global step "
        rf"{MAX_STEPS}\): nothing was exported to {re.escape(str(root / 'draft'))} \(no partial folder left\); the "
        rf"trained draft is in (\S+)( \(saved now\))?; export it with: cli.py export (\S+) (\S+)",
        message,
    )
    assert found, message
    ckpt = Path(found[1])
    assert found[3] == str(ckpt) and found[4] == str(root / "draft")
    assert _leftovers(tmp_path) == [] and not (root / "draft").exists()
    assert torch.load(ckpt, weights_only=False)["global_step"] == MAX_STEPS

    exported = _cli(tmp_path, "export", str(ckpt), str(root / "draft"))  # the command the message names
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (root / "draft" / "model.safetensors").is_file()
