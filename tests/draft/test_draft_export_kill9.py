"""``kill -9`` in the middle of ``cli.py export --overwrite``: the previous export stays complete under its name,
the killed writer's leftover is hidden and removed by the next export, which then replaces the old one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from draft_helpers import tiny_draft
from safetensors.torch import load_file

from lightning_eagle import checkpoint_keys as keys
from lightning_eagle.draft import export_draft

REPO = Path(__file__).resolve().parents[2]
# The export of the checkpoint, stalled after its weights are written and before the folder takes its name.
DRIVER = """
import sys, time
from pathlib import Path
import lightning_eagle.draft.export as export
original = export.save_file
def stalled(*args, **kwargs):
    original(*args, **kwargs)
    Path(sys.argv[3]).write_text("written")
    time.sleep(120)
export.save_file = stalled
from lightning_eagle.commands.cli import main
main(["export", sys.argv[1], sys.argv[2], "--overwrite"])
"""


@pytest.mark.slow
def test_kill_9_during_an_overwriting_export_keeps_the_previous_one(tmp_path):
    old = tiny_draft(seed=1)
    out = export_draft(old, tmp_path / "served", dtype=torch.float32)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    new = tiny_draft(seed=2)
    ckpt = tmp_path / "last.ckpt"
    state = {f"draft.{k}": v for k, v in new.state_dict().items()}
    torch.save({"state_dict": state, keys.DRAFT_FAMILY: "eagle3", keys.DRAFT_CONFIG: new.config.to_dict()}, ckpt)
    marker = tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(ckpt), str(out), str(marker)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()[0].decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old export, whole
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".served.")]
    assert leftovers and all(n.endswith(".partial") for n in leftovers)  # hidden, never under the final name
    done = subprocess.run([sys.executable, str(REPO / "cli.py"), "export", str(ckpt), str(out), "--overwrite"],
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".served.")]  # cleaned up
    assert torch.equal(load_file(out / "model.safetensors")["fc.weight"], new.state_dict()["fc.weight"])
