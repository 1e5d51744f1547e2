"""CPU benchmark: routed experts of one MoE layer, grouped vs looped, and the whole k3-tiny forward before/after
(eager MLA + looped experts vs SDPA MLA + grouped experts), measured side by side in the same run.

    python benchmarks/moe_experts.py [--tokens 512 4096] [--shapes k3-tiny wide] [--storages dequantized mxfp4]
                                     [--model-lengths 4096] [--repeats 3] [--threads N]

Expert paths (same module, same routes):

* ``naive``: ``RoutedExperts.forward_naive``, the per-expert loop with boolean masks (the readable twin);
* ``sorted loop``: the previous ``forward`` (tokens sorted by expert, counts read to the host, one GEMM pair per
  expert in a Python loop; MXFP4 decoded per expert), reproduced here as the baseline;
* ``grouped bmm`` / ``grouped_mm``: ``RoutedExperts.forward`` with ``experts_backend`` set.

Paths are timed interleaved (round-robin), median of ``--repeats``. On a CPU shared with other jobs, run with
``--threads 1``: with more threads than idle cores every small op waits at an OpenMP barrier for descheduled
threads, which penalises the many-small-GEMM paths far beyond their cost on a quiet machine.

Routes are uniform random top-k (every expert gets ~N·k/E rows). Shapes: ``k3-tiny`` (8 experts, top-2, H_l 96,
I 32) and ``wide`` (64 experts, top-8, H_l 512, I 256). Ratios are sorted-loop time / path time (higher = faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name
from lightning_eagle.k3.experts import RoutedExperts, grouped_mm_runs
from lightning_eagle.k3.model import set_backends
from lightning_eagle.k3.mxfp4 import encode_mxfp4

SHAPES = {"k3-tiny": (8, 2, 96, 32), "wide": (64, 8, 512, 256)}  # experts, top-k, H_l, I


def median_times(fns: dict, repeats: int) -> dict:
    """Median wall time of each function, the functions interleaved round-robin so that load from other processes
    on a shared machine falls on all of them alike."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def previous_forward(self: RoutedExperts, z, topk_idx, topk_weight):
    """The looped ``RoutedExperts.forward`` this library had before the grouped one (the baseline)."""
    N, k = topk_idx.shape
    out = torch.zeros(N, z.shape[-1], dtype=torch.float32, device=z.device)
    flat_local = (topk_idx - self.start).reshape(-1)
    pairs = ((flat_local >= 0) & (flat_local < self.count)).nonzero().squeeze(-1)
    if pairs.numel() == 0:
        return out
    pairs = pairs[flat_local[pairs].argsort(stable=True)]
    experts = flat_local[pairs]
    tokens = pairs // k
    counts = torch.bincount(experts, minlength=self.count).tolist()
    z_sorted = z[tokens]
    y = torch.empty_like(z_sorted)
    offset = 0
    for e, c in enumerate(counts):
        if c:
            y[offset : offset + c] = self.expert(e, z_sorted[offset : offset + c])
        offset += c
    out.index_add_(0, tokens, y.float() * topk_weight.reshape(-1)[pairs].float()[:, None])
    return out


def build_experts(shape: str, storage: str) -> RoutedExperts:
    E, _, H, inter = SHAPES[shape]
    torch.manual_seed(0)
    experts = RoutedExperts(E, H, inter, storage=storage)
    if storage == "dequantized":
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.05)
    else:
        for stem, rows, cols in (("gate_up", 2 * inter, H), ("down", H, inter)):
            for local in range(E):
                packed, scale = encode_mxfp4(0.05 * torch.randn(rows, cols))
                getattr(experts, f"{stem}_packed")[local] = packed
                getattr(experts, f"{stem}_scale")[local] = scale
    return experts.requires_grad_(False)


def expert_paths(experts: RoutedExperts) -> dict:
    def grouped(backend):
        def run(z, idx, w):
            experts.experts_backend = backend
            return experts(z, idx, w)

        return run

    paths = {
        "naive": experts.forward_naive,
        "sorted loop": partial(previous_forward, experts),
        "grouped bmm": grouped("bmm"),
    }
    if grouped_mm_runs(torch.device("cpu"), torch.float32):
        paths["grouped_mm"] = grouped("grouped_mm")
    return paths


@torch.no_grad()
def experts_table(args) -> None:
    print("### One MoE layer's routed experts (fp32)")
    print()
    names = list(expert_paths(build_experts("k3-tiny", "dequantized")))
    print(
        "| shape | storage | N | "
        + " | ".join(f"{n} (ms)" for n in names)
        + " | "
        + " | ".join(f"{n} ratio" for n in names if n != "sorted loop")
        + " |"
    )
    print("|" + "---|" * (3 + 2 * len(names) - 1))
    for shape in args.shapes:
        E, k, H, _ = SHAPES[shape]
        for storage in args.storages:
            experts = build_experts(shape, storage)
            paths = expert_paths(experts)
            for N in args.tokens:
                gen = torch.Generator().manual_seed(1)
                z = torch.randn(N, H, generator=gen)
                idx = torch.rand(N, E, generator=gen).topk(k, dim=-1).indices
                w = torch.rand(N, k, generator=gen)
                t = median_times({n: partial(fn, z, idx, w) for n, fn in paths.items()}, args.repeats)
                base = t["sorted loop"]
                times = " | ".join(f"{t[n] * 1e3:.2f}" for n in names)
                ratios = " | ".join(f"{base / t[n]:.2f}x" for n in names if n != "sorted loop")
                print(f"| {shape} | {storage} | {N} | {times} | {ratios} |")


@torch.no_grad()
def model_table(args) -> None:
    print()
    print("### Whole k3-tiny forward (fp32, B=1, no padding)")
    print()
    config = config_from_name("k3-tiny")
    before = KimiK3ForCausalLM(config, mla_backend="eager").init_weights(0).freeze()
    for layer in before.model.layers:
        if hasattr(layer, "block_sparse_moe"):
            experts = layer.block_sparse_moe.experts
            experts.forward = partial(previous_forward, experts)
    after = KimiK3ForCausalLM(config).init_weights(0).freeze()
    set_backends(after, mla_backend="sdpa")
    print("| T | before: eager + sorted loop (ms) | after: SDPA + grouped (ms) | ratio | max abs logit diff |")
    print("|---|---|---|---|---|")
    for T in args.model_lengths:
        ids = torch.randint(0, config.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))
        t = median_times({"before": partial(before, ids), "after": partial(after, ids)}, args.repeats)
        t_before, t_after = t["before"], t["after"]
        diff = (before(ids).logits - after(ids).logits).abs().max().item()
        print(f"| {T} | {t_before * 1e3:.1f} | {t_after * 1e3:.1f} | {t_before / t_after:.2f}x | {diff:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--storages", nargs="+", default=["dequantized", "mxfp4"], choices=["dequantized", "mxfp4"])
    parser.add_argument("--model-lengths", type=int, nargs="*", default=[4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print()
    experts_table(args)
    if args.model_lengths:
        model_table(args)


if __name__ == "__main__":
    main()
