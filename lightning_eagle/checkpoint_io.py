"""Checkpoint files that survive ``kill -9``: atomic writes, and a clear error for a truncated or foreign file.

Lightning's ``TorchCheckpointIO`` writes the final file name directly; a crash in the middle of a save leaves a
truncated ``last.ckpt`` that ``--ckpt_path last`` then picks up and fails on with a pickle traceback.
:class:`AtomicCheckpointIO` writes through :func:`lightning_eagle.atomic.atomic_file` instead, and turns an
unreadable checkpoint into one :class:`CheckpointLoadError` that names the file and what to do.

Every draft-training module installs it on the trainer's strategy at ``setup`` unless the trainer was given another
``CheckpointIO`` plugin (an FSDP-sharded draft saves a distributed checkpoint folder, which does not use it: read one
with :func:`load_dcp_checkpoint`).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _load as pl_load
from typing_extensions import override

from lightning_eagle.atomic import atomic_file


class CheckpointLoadError(ValueError):
    """A checkpoint file that is missing, truncated, corrupt or not a Lightning checkpoint."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic saves and readable load errors."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        with atomic_file(path) as tmp:
            torch.save(checkpoint, tmp)
            self.before_publish(tmp, Path(path))

    def before_publish(self, tmp: Path, final: Path) -> None:
        """Called with the complete temporary file just before it takes its final name (a test hook)."""

    @override
    def load_checkpoint(self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None):
        return load_checkpoint_file(path, map_location=map_location, weights_only=weights_only)


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None) -> dict:
    """``torch.load`` of a Lightning checkpoint, or a :class:`CheckpointLoadError` that says what is wrong."""
    path = Path(path)
    if not path.exists():
        raise CheckpointLoadError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        raise CheckpointLoadError(
            f"checkpoint {str(path)!r} is a folder (a distributed checkpoint of an FSDP-sharded draft?); "
            "pass the .ckpt file written by a replicated-draft run"
        )
    try:
        checkpoint = pl_load(path, map_location=map_location or "cpu", weights_only=weights_only)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as exc:
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}"
        if not zipfile.is_zipfile(path):
            raise CheckpointLoadError(
                f"checkpoint {str(path)!r} ({path.stat().st_size} bytes) cannot be read: it is truncated or corrupt "
                f"({detail}). Resume from another checkpoint (this library writes them atomically, so a crash during "
                "a save leaves the previous one intact)"
            ) from None
        raise CheckpointLoadError(f"checkpoint {str(path)!r} cannot be loaded: {detail}") from exc
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        got = sorted(checkpoint)[:6] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointLoadError(
            f"checkpoint {str(path)!r} is not a Lightning checkpoint of this library: expected a dict with "
            f"'state_dict', got {got}"
        )
    return checkpoint


LIGHTNING_DCP_RECORD = "meta.pt"  # Lightning's ModelParallelStrategy saves the non-tensor entries here


def load_dcp_checkpoint(folder: str | os.PathLike) -> dict:
    """A DCP checkpoint folder (an FSDP2-sharded draft's run with ``save_distributed_checkpoint``) consolidated into
    one checkpoint dict (single process, ``dcp_to_torch_save``), with Lightning's record of the run (``meta.pt``:
    the draft config, target fingerprint, …) when the folder has it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise CheckpointLoadError(f"export source {str(folder)!r} is a folder but not a sharded checkpoint (no "
                                  f".metadata): {_what_folder_is(folder)}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "consolidated.pt"
        try:
            dcp_to_torch_save(str(folder), str(target))
        except (AssertionError, RuntimeError, OSError, ValueError, EOFError) as exc:
            raise CheckpointLoadError(f"sharded checkpoint {str(folder)!r} cannot be read: {exc}") from exc
        checkpoint = torch.load(target, map_location="cpu", weights_only=False)
    record = folder / LIGHTNING_DCP_RECORD
    if record.is_file():
        checkpoint = {**torch.load(record, map_location="cpu", weights_only=False), **checkpoint}
    return checkpoint


def _what_folder_is(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "it is empty"
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return "it looks like an export (config.json + safetensors); export reads a checkpoint written by fit"
    found = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.ckpt"))
    if found:
        return f"it holds checkpoints: pass one of them ({', '.join(found[:4])}{', …' if len(found) > 4 else ''})"
    return f"it holds {', '.join(names[:5])}{', …' if len(names) > 5 else ''}"
