"""CPU benchmark: the MLA attention core, eager (fp32 ``[B,n,T,T]`` scores) vs SDPA (fused kernel), time and peak
memory, measured side by side in the same run.

    python benchmarks/mla_attention.py [--lengths 1024 4096 16384] [--heads 8] [--masks causal packed]
                                       [--repeats 3] [--threads N] [--dtype float32]

Both twins get the same ``q, k [B,n,T,192]``, ``v [B,n,T,128]`` (K3's widths) and mask: ``causal`` (no mask
tensor) or ``packed`` (a boolean ``[B,1,T,T]`` mask of two packed documents). Only the attention core differs
between the two paths (the projections are shared), so the core is what is timed.

Peak memory: each case runs in a fresh subprocess with glibc told to serve every allocation above 128 KiB by
``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set at once. After the inputs exist and
one warm-up call has run, the kernel's resident-set high-water mark is reset (``/proc/self/clear_refs`` ← 5) and one
more call runs; the reported peak is ``VmHWM − VmRSS`` at the reset: the extra resident memory of that call
(inputs excluded, output included). Linux only. ``--max-eager-gb`` skips eager cases whose fp32 scores alone would
exceed the budget (the table says so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from target_forward import median_time  # a sibling script: benchmarks/ is on sys.path when run as a script

from lightning_eagle.ops.mla import causal_allowed_mask, eager_attention, sdpa_attention

QK, V = 192, 128
TWINS = {"eager": eager_attention, "sdpa": sdpa_attention}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_mb(fn) -> float:
    """Extra resident memory (MiB) of one call of ``fn`` (see the module docstring)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    out = fn()
    peak = _status_kb("VmHWM")
    del out
    return (peak - before) / 1024


@torch.no_grad()
def child(impl: str, T: int, heads: int, mask_kind: str, repeats: int, dtype: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    q, k = (torch.randn(1, heads, T, QK, generator=gen).to(dt) for _ in range(2))
    v = torch.randn(1, heads, T, V, generator=gen).to(dt)
    mask = None
    if mask_kind == "packed":
        docs = torch.ones(1, T, dtype=torch.long)
        docs[:, T // 2 :] = 2
        causal = causal_allowed_mask(None, T, "cpu")
        mask = causal & (docs[:, None, :, None] == docs[:, None, None, :])
    fn = lambda: TWINS[impl](q, k, v, mask, QK**-0.5)  # noqa: E731
    seconds = median_time(fn, repeats)
    return {"seconds": seconds, "peak_mb": peak_extra_mb(fn)}


def run_case(args, impl: str, T: int, mask_kind: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    cmd = [sys.executable, __file__, "--child", impl, str(T), str(args.heads), mask_kind, str(args.repeats)]
    cmd += ["--dtype", args.dtype] + (["--threads", str(args.threads)] if args.threads else [])
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--masks", nargs="+", default=["causal", "packed"], choices=["causal", "packed"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-eager-gb", type=float, default=4.0, help="skip eager when its fp32 scores exceed this")
    parser.add_argument("--child", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        impl, T, heads, mask_kind, repeats = args.child
        print(json.dumps(child(impl, int(T), int(heads), mask_kind, int(repeats), args.dtype)))
        return
    print(
        f"B=1, {args.heads} heads, d_qk {QK}, d_v {V}, {args.dtype}, torch {torch.__version__}, "
        f"{args.threads or torch.get_num_threads()} threads, median of {args.repeats}; peak = extra resident MiB "
        "of one call (fresh process per case)"
    )
    print()
    print("| T | mask | eager (ms) | SDPA (ms) | time ratio | eager peak (MiB) | SDPA peak (MiB) | memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for T in args.lengths:
        for mask_kind in args.masks:
            scores_gb = args.heads * T * T * 4 / 2**30
            sdpa = run_case(args, "sdpa", T, mask_kind)
            if scores_gb > args.max_eager_gb:
                print(
                    f"| {T} | {mask_kind} | skipped (scores {scores_gb:.1f} GiB) | {sdpa['seconds'] * 1e3:.1f} | – | – "
                    f"| {sdpa['peak_mb']:.0f} | – |"
                )
                continue
            eager = run_case(args, "eager", T, mask_kind)
            print(
                f"| {T} | {mask_kind} | {eager['seconds'] * 1e3:.1f} | {sdpa['seconds'] * 1e3:.1f} | "
                f"{eager['seconds'] / sdpa['seconds']:.1f}x | {eager['peak_mb']:.0f} | {sdpa['peak_mb']:.0f} | "
                f"{eager['peak_mb'] / max(sdpa['peak_mb'], 1e-3):.1f}x |"
            )


if __name__ == "__main__":
    main()
