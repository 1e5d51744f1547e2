"""CPU benchmark: expert dispatch per MoE layer at EP 1 and EP 2 (forked gloo ranks, 1 thread each).

    python benchmarks/expert_parallel.py [--tokens 256 1024 4096] [--iters 20] [--shape k3-tiny|wide]

Every rank holds ``T`` tokens (its own batch) and routes them top-k over ``E`` experts; EP 1 runs all experts in one
process (``local_dispatch``), EP 2 splits them over two ranks with the all-to-all dispatcher (``"torch"``, the
default) or its all-gather + all-reduce twin. Prints a markdown table of median milliseconds per MoE-layer dispatch
(rank 0) and the ratios to EP 1 (< 1: EP 2 is faster per layer; each EP 2 rank computes half the experts for twice
the tokens, so the ratio is ≈ 1 + communication). On a shared 2-core machine absolute numbers are noisy; the
ratios are what to read.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist

from lightning_eagle.k3.experts import RoutedExperts
from lightning_eagle.k3.moe import local_dispatch
from lightning_eagle.parallel.dispatcher import AllGatherExpertDispatcher, TorchExpertDispatcher
from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.parallel.shard import expert_range

# (num_experts, top_k, expert hidden D, expert intermediate I)
SHAPES = {
    "k3-tiny": (8, 2, 96, 32),  # the k3-tiny preset's latent MoE
    "wide": (32, 8, 512, 256),  # closer to K3's ratios (896 experts top-16, D=3584, I=3072), still CPU-sized
}


def _experts(shape, expert_slice):
    E, _, D, inter = shape
    experts = RoutedExperts(E, D, inter, expert_slice)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / D**0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / inter**0.5)
    return experts.requires_grad_(False)


def _routing(rank, tokens, shape):
    E, K, D, _ = shape
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, D, generator=gen)
    idx = torch.rand(tokens, E, generator=gen).topk(K, dim=-1).indices  # uniform random top-k
    weight = torch.rand(tokens, K, generator=gen)
    return x, idx, weight / weight.sum(-1, keepdim=True)


@torch.no_grad()
def _time_rank(rank, world, shape, tokens_list, iters):
    experts = _experts(shape, expert_range(shape[0], world, rank))
    dispatchers = {"local": local_dispatch} if world == 1 else {
        "all_to_all": TorchExpertDispatcher(),
        "all_gather": AllGatherExpertDispatcher(),
    }  # fmt: skip
    results = {}
    for tokens in tokens_list:
        x, idx, weight = _routing(rank, tokens, shape)
        for name, dispatch in dispatchers.items():
            dispatch(experts, x, idx, weight)  # warm-up
            times = []
            for _ in range(iters):
                dist.barrier()  # start together, so waiting on the slower rank counts once per call
                start = time.perf_counter()
                dispatch(experts, x, idx, weight)
                times.append(time.perf_counter() - start)
            results[(tokens, name)] = statistics.median(times)
    return results


def traffic_per_token(E: int, K: int, ep: int, act_bytes: int) -> tuple[float, float]:
    """Bytes one rank sends per token of its own, in units of the expert width D (routing metadata ignored).

    All-to-all: the token goes to each *other* rank owning one of its K experts (activation dtype) and the fp32
    partial sum comes back. All-gather twin: the token goes to all ep−1 other ranks, and a ring all-reduce of the
    fp32 partial sums over ep·T rows sends 2(ep−1)/ep of them per rank.
    """
    no_local_expert = math.comb(E - E // ep, K) / math.comb(E, K)  # P(none of the K experts on a given rank)
    remote_ranks = (ep - 1) * (1 - no_local_expert)
    all_to_all = remote_ranks * (act_bytes + 4)
    all_gather = (ep - 1) * act_bytes + 2 * (ep - 1) * 4
    return all_to_all, all_gather


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="k3-tiny")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    ep1 = launch_local(_time_rank, 1, shape, args.tokens, args.iters, timeout_s=600)[0]
    ep2 = launch_local(_time_rank, 2, shape, args.tokens, args.iters, timeout_s=600)[0]
    E, K, D, inter = shape
    print(
        f"shape {args.shape}: E={E} top-{K}, D={D}, I={inter}; fp32, gloo, 1 thread per rank, "
        f"torch {torch.__version__}; median of {args.iters} calls, rank 0"
    )
    print()
    print(
        "| tokens/rank | EP1 local (ms) | EP2 all-to-all (ms) | EP2 all-gather (ms) | a2a / EP1 | gather / EP1 "
        "| gather / a2a |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        local, a2a, gather = ep1[(tokens, "local")], ep2[(tokens, "all_to_all")], ep2[(tokens, "all_gather")]
        print(
            f"| {tokens} | {local * 1e3:.2f} | {a2a * 1e3:.2f} | {gather * 1e3:.2f} | {a2a / local:.2f} | "
            f"{gather / local:.2f} | {gather / a2a:.2f} |"
        )
    print()
    print("Bytes sent per rank per token (× D), bf16 activations, uniform routing:")
    print()
    print("| model | EP | all-to-all | all-gather + all-reduce | gather / a2a |")
    print("|---|---:|---:|---:|---:|")
    for model, (E, K) in (("this shape", shape[:2]), ("K3 (896 experts, top-16)", (896, 16))):
        for ep in (2, 8, 32, 64):
            if E % ep:
                continue
            a2a, gather = traffic_per_token(E, K, ep, act_bytes=2)
            print(f"| {model} | {ep} | {a2a:.1f} | {gather:.1f} | {gather / a2a:.1f} |")


if __name__ == "__main__":
    main()
