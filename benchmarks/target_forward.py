"""CPU benchmark: chunked vs naive KDA, and the whole k3-tiny forward with each, measured in the same run.

    python benchmarks/target_forward.py [--lengths 256 1024 4096] [--repeats 3] [--threads N]

Prints a markdown table of median wall times and naive/chunked ratios (higher = chunked is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name
from lightning_eagle.k3.kda import KimiDeltaAttention


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--preset", default="k3-tiny")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = config_from_name(args.preset)
    layers = {b: KimiDeltaAttention(config, backend=b) for b in ("naive", "chunk")}
    state = layers["naive"].state_dict()
    layers["chunk"].load_state_dict(state)
    models = {b: KimiK3ForCausalLM(config, kda_backend=b).init_weights(0).freeze() for b in ("naive", "chunk")}
    print(
        f"preset {args.preset}, B=1, fp32, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats}"
    )
    print()
    print(
        "| T | KDA layer naive (ms) | KDA layer chunked (ms) | ratio | model naive (ms) | model chunked (ms) | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for T in args.lengths:
        x = torch.randn(1, T, config.hidden_size)
        ids = torch.randint(0, config.vocab_size, (1, T))
        layer_t = {b: median_time(lambda b=b: layers[b](x), args.repeats) for b in layers}
        model_t = {b: median_time(lambda b=b: models[b](ids), args.repeats) for b in models}
        print(
            f"| {T} | {layer_t['naive'] * 1e3:.1f} | {layer_t['chunk'] * 1e3:.1f} | "
            f"{layer_t['naive'] / layer_t['chunk']:.1f}x | {model_t['naive'] * 1e3:.1f} | "
            f"{model_t['chunk'] * 1e3:.1f} | {model_t['naive'] / model_t['chunk']:.1f}x |"
        )


if __name__ == "__main__":
    main()
