"""``kill -9`` in the middle of a checkpoint save, then ``--ckpt_path last``: the run completes and ends with the
same draft as an uninterrupted run; no partial file is ever visible under a checkpoint's final name; at most one
checkpoint interval of steps is recomputed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
INTERVAL, MAX_STEPS = 3, 9


def _config(tmp_path: Path, name: str, stall: bool) -> Path:
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(
        max_steps=MAX_STEPS, limit_val_batches=0, enable_progress_bar=False, default_root_dir=str(tmp_path / name)
    )
    trainer["callbacks"] = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"every_n_train_steps": INTERVAL, "save_top_k": -1, "save_last": True}},
        {"class_path": "lightning_eagle.training.export_callback.ExportDraftCallback"},
    ]  # fmt: skip
    if stall:
        trainer["plugins"] = [{"class_path": "kill_helpers.StallingCheckpointIO"}]
    path = tmp_path / f"{name}-{'stall' if stall else 'plain'}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _fit(config: Path, tmp_path: Path, *extra: str, wait: bool = True, env_extra: dict | None = None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
           "LIGHTNING_EAGLE_CACHE": str(tmp_path / "cache"), **(env_extra or {})}  # fmt: skip
    cmd = [sys.executable, str(REPO / "cli.py"), "fit", "--config", str(config), *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def _visible_checkpoints(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_save_then_resume_matches_the_uninterrupted_run(tmp_path):
    _fit(_config(tmp_path, "full", stall=False), tmp_path)

    marker = tmp_path / "stalled"
    proc = _fit(_config(tmp_path, "cut", stall=True), tmp_path, wait=False,
                env_extra={"STALL_AT": f"step={2 * INTERVAL}.ckpt", "STALL_MARKER": str(marker)})  # fmt: skip
    deadline = time.monotonic() + 480
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run never reached its second checkpoint"
        time.sleep(0.2)
    partial = Path(marker.read_text())
    assert partial.is_file() and partial.name.startswith(".") and partial.name.endswith(".partial")
    os.kill(proc.pid, signal.SIGKILL)  # mid-save: the step-6 bytes are written, not yet renamed
    proc.communicate(timeout=60)

    ckpt_dir = tmp_path / "cut" / "checkpoints"
    visible = _visible_checkpoints(ckpt_dir)
    assert [p.name for p in visible] == [f"epoch=0-step={INTERVAL}.ckpt", "last.ckpt"]
    for path in visible:  # every file under a final name is complete
        assert torch.load(path, weights_only=False)["global_step"] == INTERVAL
    assert not (tmp_path / "cut" / "draft").exists()

    out = _fit(_config(tmp_path, "cut", stall=False), tmp_path, "--ckpt_path", "last")
    assert "Restoring states from the checkpoint path" in out and "last.ckpt" in out
    # Lost work: the killed save was at step 6; the run restarted from step 3 = one interval.
    assert not [p for p in ckpt_dir.iterdir() if p.name.endswith(".partial")]  # the next save of that name cleaned up
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=False)["global_step"] == MAX_STEPS

    full = load_file(str(tmp_path / "full" / "draft" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "cut" / "draft" / "model.safetensors"))
    assert full.keys() == resumed.keys()
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=1e-5, atol=1e-6, msg=key)
