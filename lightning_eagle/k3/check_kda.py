"""Whole-model check of the fast KDA backends against the naive per-token twin, and the record ``auto`` consults.

    python -m lightning_eagle.k3.check_kda --device cuda   # chunked torch, fla fused_recurrent, fla chunk vs naive
    python -m lightning_eagle.k3.check_kda --device cpu    # chunked torch vs naive

Why a whole model (`k3_target.md` §10): on an H200, flash-linear-attention 0.6.0's ``chunk`` kernel matched fla's own
naive reference on isolated random inputs yet moved a full tiny model's logits by up to 3.7. So a GPU KDA kernel is
trusted only after the k3-tiny model run with it agrees with the same model run with :func:`naive_recurrent_kda`.

The check builds k3-tiny (fp32, random weights, TF32 off) on the device, runs one right-padded batch through it once
per backend and compares the logits at real tokens: ``max |Δ| ≤ rtol · max |naive logits|`` passes. Each outcome
(pass *or* failure) is recorded per *device class* — the device name plus the torch, fla and triton versions, since
any of them can change what a kernel computes — in a small JSON file written atomically:
``$LIGHTNING_EAGLE_KDA_CHECKS``, else ``kda_checks.json`` in ``$LIGHTNING_EAGLE_CACHE`` or
``~/.cache/lightning_eagle``. ``KimiDeltaAttention(backend="auto")`` uses an fla kernel only if this file holds a
pass for it on the current device class (:func:`passed_kda_backends`); otherwise it runs the chunked torch path.

Exit status: 0 when every available backend passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.metadata
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lightning_eagle.atomic import atomic_file
from lightning_eagle.k3.kda_ops import fla_kda_available

CHECKS_ENV = "LIGHTNING_EAGLE_KDA_CHECKS"
RECORD_FORMAT = 1
DEFAULT_RTOL = 1e-3  # of the logit range: fp32 reduction-order noise is ~1e-5, the fla chunk failure was ~4x the range
FLA_BACKENDS = ("fla", "fla_chunk")  # fused_recurrent, chunk


# ---- the record ---------------------------------------------------------------------------------------------------
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


# ---- the check ----------------------------------------------------------------------------------------------------
def candidate_backends(device: torch.device | str) -> list[str]:
    """The fast backends that can run on ``device``: the chunked torch path everywhere, fla's kernels on CUDA."""
    return ["chunk", *FLA_BACKENDS] if fla_kda_available(torch.device(device)) else ["chunk"]


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """TF32 off for matmuls and cuDNN convolutions (the short conv), so only the recurrence differs between runs."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def set_kda_backend(model: torch.nn.Module, backend: str) -> None:
    from lightning_eagle.k3.kda import KimiDeltaAttention

    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            module.backend = backend


def tiny_model_and_batch(device: torch.device, seq_len: int = 200, batch: int = 2, seed: int = 0):
    """k3-tiny in fp32 with random weights and a batch whose second row is right-padded (a quarter of it).

    The default length is not a multiple of the chunk sizes (16 here, 64 in fla), so partial chunks are covered."""
    from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name

    model = KimiK3ForCausalLM(config_from_name("k3-tiny"), kda_backend="naive").init_weights(seed).freeze().to(device)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=g)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    if batch > 1:
        attention_mask[1, seq_len - seq_len // 4 :] = 0
    return model, input_ids.to(device), attention_mask.to(device)


@torch.no_grad()
def compare_kda_backends(
    device: torch.device | str,
    backends: Sequence[str] | None = None,
    rtol: float = DEFAULT_RTOL,
    seq_len: int = 200,
    seed: int = 0,
) -> list[KDACheckResult]:
    """Run k3-tiny with each backend and with ``naive``; compare logits at real tokens."""
    device = torch.device(device)
    backends = candidate_backends(device) if backends is None else list(backends)
    with full_fp32():
        model, input_ids, attention_mask = tiny_model_and_batch(device, seq_len, seed=seed)
        valid = attention_mask.bool()
        set_kda_backend(model, "naive")
        reference = model(input_ids, attention_mask).logits[valid].float()
        tolerance = rtol * reference.abs().max().item()
        results = []
        for backend in backends:
            set_kda_backend(model, backend)
            try:
                logits = model(input_ids, attention_mask).logits[valid].float()
            except Exception as error:  # a kernel that cannot run here fails the check; the message says why
                results.append(KDACheckResult(backend, None, tolerance, False, f"{type(error).__name__}: {error}"))
                continue
            diff = (logits - reference).abs().max().item()
            passed = bool(torch.isfinite(logits).all()) and diff <= tolerance
            results.append(KDACheckResult(backend, diff, tolerance, passed))
    return results


def format_results(device: torch.device | str, results: Sequence[KDACheckResult]) -> str:
    lines = [f"KDA whole-model check on {device_class_key(device)} (k3-tiny, fp32, vs naive)"]
    lines.append(f"{'backend':<12} {'max |Δ logits|':>16} {'tolerance':>12}  result")
    for r in results:
        diff = "—" if r.max_abs_diff is None else f"{r.max_abs_diff:.3e}"
        verdict = "PASS" if r.passed else "FAIL" + (f" ({r.error})" if r.error else "")
        lines.append(f"{r.backend:<12} {diff:>16} {r.tolerance:>12.3e}  {verdict}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_eagle.k3.check_kda",
        description="Check KDA backends against the naive twin on a whole k3-tiny model and record the result.",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", nargs="*", default=None, help="default: every backend that can run here")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="tolerance as a fraction of max |logits|")
    parser.add_argument("--seq-len", type=int, default=200)
    parser.add_argument("--no-record", action="store_true", help=f"do not write {CHECKS_ENV} / the cache record")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here", file=sys.stderr)
        return 2
    results = compare_kda_backends(device, args.backends, args.rtol, args.seq_len)
    print(format_results(device, results))
    if device.type == "cuda" and not fla_kda_available(device):
        print("fla (flash-linear-attention) is not installed: only the chunked torch path was checked")
    if not args.no_record:
        print(f"recorded in {record_kda_check(device, results)}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
