"""A real SIGTERM (how a scheduler preempts) or SIGINT during ``cli.py fit``: the step in flight ends, a resumable
checkpoint is saved and named, the exit status is 128 + signal, nothing is exported; ``--ckpt_path last`` then ends
with the same draft as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 6


def _config(tmp_path: Path, name: str, signal_at: int | None, signum: int = signal.SIGTERM) -> Path:
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config["trainer"].update(
        max_steps=MAX_STEPS, limit_val_batches=0, enable_progress_bar=False, default_root_dir=str(tmp_path / name)
    )
    callbacks = [{"class_path": "lightning_eagle.training.export_callback.ExportDraftCallback"}]
    if signal_at is not None:
        callbacks.append({"class_path": "kill_helpers.SignalAtStep", "init_args": {"at_batch": signal_at,
                                                                                 "signum": int(signum)}})  # fmt: skip
    config["trainer"]["callbacks"] = callbacks
    path = tmp_path / f"{name}-{signal_at}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _fit(config: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
           "LIGHTNING_EAGLE_CACHE": str(tmp_path / "cache")}  # fmt: skip
    cmd = [sys.executable, str(REPO / "cli.py"), "fit", "--config", str(config), *extra]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_143_and_the_resume_matches_the_uninterrupted_run(tmp_path):
    full = _fit(_config(tmp_path, "full", None), tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]

    cut = _fit(_config(tmp_path, "cut", signal_at=2), tmp_path)
    ckpt = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert cut.returncode == 128 + signal.SIGTERM, cut.stderr[-3000:]
    errors = [line for line in cut.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: fit stopped by SIGTERM after global step 3: a resumable checkpoint is at {ckpt}; continue with "
        f"--ckpt_path {ckpt} (nothing was exported)"
    ], cut.stderr[-3000:]
    assert "Traceback" not in cut.stderr
    assert torch.load(ckpt, weights_only=False)["global_step"] == 3  # the step in flight when the signal came ended
    assert not (tmp_path / "cut" / "draft").exists()

    resumed = _fit(_config(tmp_path, "cut", None), tmp_path, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {ckpt}" in resumed.stdout + resumed.stderr
    a = load_file(str(tmp_path / "full" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "draft" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
def test_ctrl_c_in_the_first_step_saves_that_step_and_exits_130(tmp_path):
    cut = _fit(_config(tmp_path, "early", signal_at=0, signum=signal.SIGINT), tmp_path)
    ckpt = tmp_path / "early" / "checkpoints" / "last.ckpt"
    assert cut.returncode == 128 + signal.SIGINT, cut.stderr[-3000:]
    assert f"error: fit stopped by SIGINT after global step 1: a resumable checkpoint is at {ckpt}" in cut.stderr
    assert torch.load(ckpt, weights_only=False)["global_step"] == 1
    assert not (tmp_path / "early" / "draft").exists()
