"""Check the fast KDA backends against the naive per-token twin on a whole k3-tiny model and record the outcome —
the record ``kda_backend="auto"`` consults before it runs an fla kernel (`k3_target.md` §10).

    python -m lightning_eagle.commands.check_kda --device cuda  # chunked torch, fla fused_recurrent, fla chunk vs naive
    python -m lightning_eagle.commands.check_kda --device cpu   # chunked torch vs naive

The comparison is :func:`lightning_eagle.k3.kda_compare.compare_kda_backends`; the record (per device class, written
atomically) is :mod:`lightning_eagle.k3.kda_records`. Exit status: 0 when every checked backend passed, 1 otherwise,
2 when the device is not there.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.k3.kda_compare import DEFAULT_RTOL, compare_kda_backends
from lightning_eagle.k3.kda_ops import fla_kda_available
from lightning_eagle.k3.kda_records import CHECKS_ENV, KDACheckResult, device_class_key, record_kda_check


def format_results(device: torch.device | str, results: Sequence[KDACheckResult]) -> str:
    lines = [f"KDA whole-model check on {device_class_key(device)} (k3-tiny, fp32, vs naive)"]
    lines.append(f"{'backend':<12} {'max |Δ logits|':>16} {'tolerance':>12}  result")
    for r in results:
        diff = "—" if r.max_abs_diff is None else f"{r.max_abs_diff:.3e}"
        verdict = "PASS" if r.passed else "FAIL" + (f" ({r.error})" if r.error else "")
        lines.append(f"{r.backend:<12} {diff:>16} {r.tolerance:>12.3e}  {verdict}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m lightning_eagle.commands.check_kda",
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
