"""The record of which KDA backends passed the whole-model check on which *device class* — what
``kda_backend="auto"`` consults before it runs an fla kernel (`k3_target.md` §10).

A device class is the device name plus the torch, fla and triton versions, since any of them can change what a kernel
computes. Each outcome (pass *or* failure) is kept in a small JSON file written atomically:
``$LIGHTNING_EAGLE_KDA_CHECKS``, else ``kda_checks.json`` in ``$LIGHTNING_EAGLE_CACHE`` or ``~/.cache/lightning_eagle``.
The check that fills it is :func:`lightning_eagle.k3.kda_compare.compare_kda_backends`, run by
``python -m lightning_eagle.commands.check_kda``.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lightning_eagle.atomic import atomic_file

CHECKS_ENV = "LIGHTNING_EAGLE_KDA_CHECKS"
RECORD_FORMAT = 1


def checks_path() -> Path:
    """``$LIGHTNING_EAGLE_KDA_CHECKS``, else ``kda_checks.json`` in the package cache folder."""
    explicit = os.environ.get(CHECKS_ENV)
    if explicit:
        return Path(explicit)
    root = os.environ.get("LIGHTNING_EAGLE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lightning_eagle")
    return Path(root) / "kda_checks.json"


@functools.cache  # `auto` asks on every KDA call; a metadata lookup scans site-packages
def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.cache
def _device_name(kind: str, index: int | None) -> str:
    if kind == "cuda":
        return torch.cuda.get_device_name(index)
    return kind


def device_class(device: torch.device | str) -> dict[str, str]:
    """What a check result is valid for: the device name and the versions of everything that compiles KDA kernels."""
    device = torch.device(device)
    return {
        "device": _device_name(device.type, device.index),
        "torch": torch.__version__,
        "fla": _version("flash-linear-attention"),
        "triton": _version("triton"),
    }


def device_class_key(device: torch.device | str) -> str:
    return " | ".join(f"{k} {v}" if k != "device" else v for k, v in device_class(device).items())


def _read_record(path: Path) -> dict:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return {"format": RECORD_FORMAT, "checks": {}}
    return _read_record_cached(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read_record_cached(path: str, mtime_ns: int, size: int) -> dict:
    # Keyed on (mtime, size): `auto` asks on every KDA call; the file is re-read only after it changed.
    del mtime_ns, size
    with open(path) as f:
        record = json.load(f)
    if record.get("format") != RECORD_FORMAT or not isinstance(record.get("checks"), dict):
        raise ValueError(f"{path} is not a KDA check record (format {RECORD_FORMAT}); delete it and re-run the check")
    return record


def passed_kda_backends(device: torch.device | str) -> frozenset[str]:
    """Backends whose latest whole-model check on this device class passed."""
    entry = _read_record(checks_path())["checks"].get(device_class_key(device), {})
    return frozenset(name for name, result in entry.get("backends", {}).items() if result.get("passed"))


@dataclass
class KDACheckResult:
    """One backend's outcome of the whole-model check (what the record keeps, less the backend name)."""

    backend: str
    max_abs_diff: float | None  # max |Δ logits| against naive at real tokens (None: the backend raised)
    tolerance: float
    passed: bool
    error: str | None = None


def record_kda_check(device: torch.device | str, results: Sequence[KDACheckResult]) -> Path:
    """Merge ``results`` into the record under this device class (replacing earlier results of the same backends) and
    write the file atomically, so a concurrent reader sees the old record or the new one, never a torn file."""
    path = checks_path()
    record = _read_record(path)
    record = {"format": RECORD_FORMAT, "checks": dict(record["checks"])}
    key = device_class_key(device)
    entry = dict(record["checks"].get(key, {**device_class(device), "backends": {}}))
    backends = dict(entry.get("backends", {}))
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for result in results:
        backends[result.backend] = {**asdict(result), "checked_at": now}
        del backends[result.backend]["backend"]
    entry["backends"] = backends
    record["checks"][key] = entry
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path
