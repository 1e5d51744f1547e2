"""A few steps of ``configs/quickstart_dspark.yaml`` through ``cli.py fit`` in a subprocess (the module tests and the
engine test's fit-exported draft); ``tests/`` is on the subprocess's ``PYTHONPATH`` for :class:`StopAtStep`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from lightning.pytorch import Callback

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_DSPARK = REPO / "configs" / "quickstart_dspark.yaml"


class StopAtStep(Callback):
    """Ends ``fit`` cleanly once ``step`` optimizer steps are done (an interrupted run with the same schedule)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def dspark_config(
    tmp_path: Path,
    name: str,
    *,
    max_steps: int,
    validate: bool = True,
    every: int = 2,
    stop_at: int | None = None,
    export_dtype: str = "float32",
) -> Path:
    """The quickstart DSpark config shrunk for a test: short rows, 2 rows a batch, 16 anchors, a checkpoint every
    ``every`` steps (all kept), the export in ``export_dtype`` (fp32: exact comparisons), everything under
    ``tmp_path / name``."""
    config = yaml.safe_load(QUICKSTART_DSPARK.read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=max_steps, enable_progress_bar=False, default_root_dir=str(tmp_path / name),
                   val_check_interval=every, limit_val_batches=1 if validate else 0, log_every_n_steps=1)  # fmt: skip
    trainer["callbacks"] = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"every_n_train_steps": every, "save_top_k": -1, "save_last": True}},
        {"class_path": "lightning_eagle.training.export_callback.ExportDraftCallback",
         "init_args": {"use_best": False, "dtype": export_dtype}},
    ]  # fmt: skip
    if stop_at is not None:
        trainer["callbacks"].append({"class_path": "dspark_fit_helpers.StopAtStep", "init_args": {"step": stop_at}})
    config["model"]["init_args"]["objective"]["num_anchors"] = 16
    config["data"].update(max_length=96, batch_size=2)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cli(tmp_path: Path, *words: str) -> str:
    """``cli.py WORDS`` in a subprocess (the tokenization cache under ``tmp_path``); its output, asserting exit 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
           "LIGHTNING_EAGLE_CACHE": str(tmp_path / "cache")}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(REPO / "cli.py"), *words], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out
