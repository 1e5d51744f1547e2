"""Eager vs flash_lse TTT attention: one K=7 TTT step (forward + backward of ``ttt_loss``) on CPU.

    python benchmarks/ttt_step.py            # T = 256, 1024, 2048 (a few minutes on 2 cores)
    python benchmarks/ttt_step.py --quick    # T = 256, 1024, one timed repeat

Prints one markdown table with times and peak memory of both backends and their ratios (flash_lse / eager).

Setup: a tiny-ish K3 draft (H=256, 8 heads, d_qk=48, d_v=32, N_d=1024 of V=4096), B=1, K=7; the teacher is computed
once outside the timed region (it is the same for both backends).

Time: best (minimum) wall time of ``--repeats`` steps after one warm-up step (the minimum is the least
noise-sensitive statistic on a shared machine), in a fresh subprocess per (T, backend).

Peak memory: a second fresh subprocess per (T, backend). Before the step it reads the current RSS
(``/proc/self/statm``); after one step it reads the process's peak RSS (``getrusage``'s ``ru_maxrss``); the difference
is the step's peak extra resident memory. That subprocess runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc
serves every large tensor from ``mmap`` and returns it on free (the default dynamic threshold would keep freed blocks
resident and inflate the peak); it is not used for timing because the extra page faults slow it down. CPU has no
allocator statistics like ``torch.cuda.max_memory_allocated``; this counts resident pages, i.e. what the machine
actually had to provide.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

BACKENDS = ("eager", "flash_lse")


def _build(T: int, seed: int = 0):
    import torch

    from lightning_eagle.draft import Eagle3DraftConfig, KimiK3Eagle3Draft
    from lightning_eagle.training import compute_teacher

    torch.manual_seed(seed)
    config = Eagle3DraftConfig(
        hidden_size=256, num_attention_heads=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, intermediate_size=512, vocab_size=4096, draft_vocab_size=1024,
        target_hidden_size=256, target_num_hidden_layers=8, aux_layer_ids=[1, 3, 4],
        aux_stream="prefix", bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    draft = KimiK3Eagle3Draft(config)
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (1, T)),
        "attention_mask": torch.ones(1, T, dtype=torch.long),
        "loss_mask": torch.ones(1, T, dtype=torch.long),
        "aux_hidden_states": torch.randn(1, T, 3 * config.target_hidden_size),
    }
    batch["attention_mask"][0, T - T // 8 :] = 0  # some right padding
    batch["loss_mask"] *= batch["attention_mask"]
    logits = torch.randn(1, T, config.vocab_size)
    teacher = compute_teacher(draft, batch["loss_mask"], target_logits=logits)
    return draft, batch, teacher


def _step(draft, batch, teacher) -> None:
    from lightning_eagle.training import ttt_loss

    draft.zero_grad(set_to_none=True)
    out = ttt_loss(draft, **batch, teacher=teacher, ttt_steps=7)
    out.loss.backward()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(mode: str, T: int, backend: str, repeats: int) -> dict:
    draft, batch, teacher = _build(T)
    draft.attention_backend = backend
    if mode == "memory":
        before = _rss_bytes()
        _step(draft, batch, teacher)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        return {"peak_mb": max(peak, 0) / 2**20}
    _step(draft, batch, teacher)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(draft, batch, teacher)
        times.append(time.perf_counter() - start)
    return {"ms": 1000 * min(times)}


def run_isolated(mode: str, T: int, backend: str, repeats: int) -> dict:
    env = dict(os.environ)
    if mode == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, str(T), backend, "--repeats", str(repeats)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(T: int, backend: str, repeats: int) -> dict:
    return {**run_isolated("time", T, backend, repeats), **run_isolated("memory", T, backend, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T in {256, 1024}, one timed repeat")
    parser.add_argument("--lengths", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "T", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.worker[2], args.repeats or 1)))
        return
    lengths = args.lengths or ([256, 1024] if args.quick else [256, 1024, 2048])
    repeats = args.repeats or (1 if args.quick else 2)
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, K=7, B=1, fwd+bwd, best of {repeats}\n")
    print("| T | eager ms | flash_lse ms | time ratio | eager peak MB | flash_lse peak MB | memory ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for T in lengths:
        eager, flash = (measure(T, backend, repeats) for backend in BACKENDS)
        print(
            f"| {T} | {eager['ms']:.0f} | {flash['ms']:.0f} | {flash['ms'] / eager['ms']:.2f} | "
            f"{eager['peak_mb']:.0f} | {flash['peak_mb']:.0f} | {flash['peak_mb'] / max(eager['peak_mb'], 1e-9):.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
