"""The wheel carries everything a user runs: configs, the bundled tiny K3, the sample data (installed, not cloned)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (path,) = out.glob("lightning_eagle-*.whl")
    return path


def test_wheel_holds_configs_assets_and_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "lightning_eagle/configs/quickstart.yaml",
        "lightning_eagle/configs/kimi_k3_eagle3.yaml",
        "lightning_eagle/assets/k3-tiny-chat/model.safetensors",
        "lightning_eagle/assets/data/synthetic_chat.jsonl",
    ):
        assert required in names, required


@pytest.mark.slow
@pytest.mark.wheel
def test_installed_wheel_runs_the_packaged_quickstart(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    # The dependencies (torch, lightning, …) come from this interpreter's site-packages, but not its .pth files:
    # the editable install of the repository must not shadow the wheel.
    Path(site, "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, text=True)  # fmt: skip
    root = tmp_path / "run"
    env = {**os.environ, "LIGHTNING_EAGLE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ""}
    cmd = [str(env_dir / "bin" / "lightning-eagle"), "fit", "--config", "quickstart", "--trainer.max_steps", "2",
           "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(root)]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    where = subprocess.run([str(python), "-c", "import lightning_eagle; print(lightning_eagle.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True).stdout  # fmt: skip
    assert where.startswith(site), where  # the wheel's copy ran, not the repository's
    assert (root / "draft" / "model.safetensors").is_file() and (root / "checkpoints" / "last.ckpt").is_file()
    assert "fit finished" in done.stdout
