"""Long context on CPU: a whole training step's peak memory against T, and the memory plan's prediction of it; the
step time of today's settings against the long-context ones.

    python benchmarks/long_context.py                 # memory at T = 2048 … 16384, then time at T = 4096 and 16384
    python benchmarks/long_context.py --quick         # T = 512, 1024 (a smoke run: what the test runs)
    python benchmarks/long_context.py --memory-only / --time-only

**Memory.** One fixed mid-size run (a widened k3-tiny target with every K3 structure — KDA, gated NoPE MLA,
AttnRes, MoE with MXFP4 experts — and its draft; fp32, since CPUs without bf16 units emulate bf16 slowly; B = 1,
K = 7) with every long-context mechanism on (``LONG``). A fresh subprocess per T builds the models, runs one warm-up
step at a short T (gradients and AdamW states allocated, kernels warmed), then measures one whole training step at
T — target forward, teacher, the K-step TTT unroll with its backward, the grad-norm pass and the optimizer step — as
the peak-RSS growth over the resident bytes (weights, gradients, optimizer states), with
:mod:`lightning_eagle.planning.cpu_probe`. The table gives each peak, its ratio to the first T (linear
memory: 16384 vs 2048 at most 8.5x), and the plan's prediction (``device="cpu"``) with its error.

**Time.** Best of ``--repeats`` whole training steps after a warm-up, fresh subprocess per (settings, T): ``TODAY``
(the settings before long context: flash_lse with its mask, full-vocabulary teacher tensors, unchunked target) and
``LONG``, at T = 4096 (the ratio LONG / TODAY) and 16384, with the TTT attention's own time measured separately
(the attention op under the same inputs) so that the quadratic part is visible on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TARGET = {  # k3-tiny widened: every K3 structure, hundreds of MB per phase at T = 16384
    "hidden_size": 256, "intermediate_size": 1024, "vocab_size": 2048, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "linear_attn_config": {"num_heads": 4, "head_dim": 64},
    "moe_intermediate_size": 256, "routed_expert_hidden_size": 256, "num_experts_per_token": 2,
    "max_position_embeddings": 65536,
}  # fmt: skip
DRAFT = {"intermediate_size": 1024}
BASE = {"B": 1, "K": 7, "N_d": 1024, "aux": [1, 3, 5], "dtype": "float32", "storage": "mxfp4", "warmup_T": 256}
TODAY = {
    **BASE, "backend": "flash_lse", "ckpt": True, "loss_backend": "plain", "kv_cache": "expanded",
    "target_token_chunk": None,
}  # fmt: skip
LONG = {
    **BASE, "backend": "flash_lse", "ckpt": True, "loss_backend": "chunked", "loss_chunk": 1024,
    "kv_cache": "latent", "target_token_chunk": 1024,
}  # fmt: skip


def plan_inputs(spec: dict, T: int):

    from lightning_eagle.draft import Eagle3DraftConfig
    from lightning_eagle.draft.export import EAGLE3
    from lightning_eagle.k3 import config_from_name
    from lightning_eagle.planning import PlanInputs
    from lightning_eagle.run_settings import DraftSettings, ObjectiveSettings, TargetSettings

    target = config_from_name("k3-tiny", **TARGET)
    draft = Eagle3DraftConfig.from_target_config(
        target, **DRAFT, aux_layer_ids=spec["aux"], draft_vocab_size=spec["N_d"]
    )  # fmt: skip
    return PlanInputs(
        target=target, draft=draft, family=EAGLE3,
        target_settings=TargetSettings(dtype=spec["dtype"], expert_storage=spec["storage"],
                                       token_chunk=spec["target_token_chunk"], aux_layer_ids=tuple(spec["aux"])),
        draft_settings=DraftSettings(dtype=spec["dtype"], attention_backend=spec["backend"],
                                     activation_checkpointing=spec["ckpt"], kv_cache=spec["kv_cache"]),
        objective=ObjectiveSettings(ttt_steps=spec["K"], loss_backend=spec["loss_backend"],
                                    loss_chunk=spec.get("loss_chunk", 1024)),
        batch_size=spec["B"], seq_len=T, accumulate_grad_batches=2, device="cpu", reserve_bytes=0,
    )  # fmt: skip


# ---- the worker (a fresh process per measurement) --------------------------------------------------------------------
def build(spec: dict, T: int):
    """Target, draft, optimizer and a ``step(T)`` closure: one whole training step on a fresh batch of length T."""
    import torch

    from lightning_eagle.draft import KimiK3Eagle3Draft
    from lightning_eagle.k3 import KimiK3ForCausalLM
    from lightning_eagle.k3.model import set_token_chunk
    from lightning_eagle.planning.eagle3_unroll_forward import ttt_attention_backend
    from lightning_eagle.training.shift import shift_left
    from lightning_eagle.training.ttt import checkpointed_draft_step, draft_step, ttt_loss

    inputs = plan_inputs(spec, T)
    target = KimiK3ForCausalLM(inputs.target, expert_storage=inputs.expert_storage).init_weights(0)
    target = target.cast_to(inputs.target_dtype).freeze()
    set_token_chunk(target, inputs.target_token_chunk)
    draft = KimiK3Eagle3Draft(inputs.draft, attention_backend=ttt_attention_backend(inputs))
    draft.kv_cache = inputs.draft_settings.kv_cache
    draft.copy_embeddings_from(target.model.embed_tokens.weight)
    draft = draft.to(inputs.draft_dtype)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95))
    step_fn = checkpointed_draft_step if inputs.activation_checkpointing else draft_step
    gen = torch.Generator().manual_seed(0)

    def step(length: int) -> None:
        ids = torch.randint(0, inputs.target.vocab_size, (inputs.batch_size, length), generator=gen)
        ones = torch.ones_like(ids)
        with torch.no_grad():
            cap = target.capture(ids, ones, aux_layer_ids=list(inputs.aux_layer_ids))
        out = ttt_loss(
            draft, shift_left(ids), ones, shift_left(ones), cap.aux_hidden_states,
            final_hidden=shift_left(cap.final_hidden), lm_head_weight=target.lm_head.weight,
            ttt_steps=inputs.objective.ttt_steps, draft_step_fn=step_fn, loss_backend=inputs.loss_backend,
            loss_chunk=inputs.loss_chunk,
        )  # fmt: skip
        del cap
        out.loss.backward()
        del out
        grads = [p.grad for p in draft.parameters() if p.grad is not None]  # Eagle3Module's grad-norm logging
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        optimizer.step()  # gradients are kept: the next micro-batch accumulates into them

    return step


def measure_memory(spec: dict, T: int) -> dict:

    import torch

    torch.set_num_threads(1)
    from lightning_eagle.planning.cpu_probe import peak, reset_peak, rss

    step = build(spec, T)
    step(spec["warmup_T"])
    before = rss()
    reset_peak()
    step(T)
    return {"step": peak() - before}


def measure_time(spec: dict, T: int, repeats: int) -> dict:
    import torch

    step = build(spec, T)
    step(spec["warmup_T"])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(T)
        times.append(time.perf_counter() - start)
    return {"s": min(times), "threads": torch.get_num_threads()}


def measure_attention(spec: dict, T: int, repeats: int) -> dict:
    """The TTT attention alone: K steps of the backend's forward + backward on the draft's shapes (random q/k/v)."""
    import torch

    from lightning_eagle.draft import get_ttt_attention
    from lightning_eagle.draft.cache import TTTCache

    inputs = plan_inputs(spec, T)
    c, dtype = inputs.draft, getattr(torch, spec["dtype"])
    n, d_qk, d_v = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    attend = get_ttt_attention(spec["backend"])
    gen = torch.Generator().manual_seed(0)

    def unroll() -> None:
        cache = TTTCache()
        cache.bind_mask(torch.ones(1, T, dtype=torch.long))
        outs = []
        for _ in range(spec["K"]):
            q = torch.randn(1, n, T, d_qk, generator=gen).to(dtype).requires_grad_()
            cache.append(torch.randn(1, n, T, d_qk, generator=gen).to(dtype).requires_grad_(),
                         torch.randn(1, n, T, d_v, generator=gen).to(dtype).requires_grad_())  # fmt: skip
            outs.append(attend(q, cache, d_qk**-0.5).float().sum())
        torch.stack(outs).sum().backward()

    unroll()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        unroll()
        times.append(time.perf_counter() - start)
    return {"s": min(times)}


def run_isolated(kind: str, name: str, T: int, repeats: int = 1) -> dict:
    from lightning_eagle.planning.cpu_probe import PROBE_ENV

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if kind == "memory":
        env.update(PROBE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--worker", kind, name, str(T), "--repeats", str(repeats)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode:
        raise RuntimeError(f"worker {kind} {name} T={T} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- the tables ------------------------------------------------------------------------------------------------------
def memory_table(lengths: list[int]) -> list[dict]:
    from lightning_eagle.planning import build_plan

    rows = []
    for T in lengths:
        measured = run_isolated("memory", "LONG", T)["step"]
        plan = build_plan(plan_inputs(LONG, T))
        planned = plan.phase_bytes(plan.peak_phase)
        rows.append({"T": T, "measured": measured, "planned": planned, "phase": plan.peak_phase})
    return rows


def print_memory(rows: list[dict]) -> None:
    print("| T | measured step peak MB | vs first T | plan MB | plan error | plan's peak phase |")
    print("|---:|---:|---:|---:|---:|---|")
    first = rows[0]["measured"]
    for r in rows:
        error = (r["planned"] - r["measured"]) / r["measured"]
        print(
            f"| {r['T']} | {r['measured'] / 1e6:.1f} | {r['measured'] / first:.2f}x | {r['planned'] / 1e6:.1f} | "
            f"{100 * error:+.1f} % | {r['phase']} |",
            flush=True,
        )


def print_time(lengths: list[int], repeats: int) -> None:
    print("| T | today s | long-context s | ratio | TTT attention alone s (K steps, fwd+bwd) |")
    print("|---:|---:|---:|---:|---:|")
    for T in lengths:
        today = run_isolated("time", "TODAY", T, repeats)["s"]
        long = run_isolated("time", "LONG", T, repeats)["s"]
        attention = run_isolated("attention", "LONG", T, repeats)["s"]
        print(f"| {T} | {today:.2f} | {long:.2f} | {long / today:.2f} | {attention:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T in {512, 1024}: a smoke run")
    parser.add_argument("--lengths", type=int, nargs="*", default=None, help="memory table lengths")
    parser.add_argument("--time-lengths", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--time-only", action="store_true")
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "SPEC", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, name, T = args.worker[0], args.worker[1], int(args.worker[2])
        spec = {"TODAY": TODAY, "LONG": LONG}[name]
        if kind == "memory":
            result = measure_memory(spec, T)
        elif kind == "time":
            result = measure_time(spec, T, args.repeats)
        else:
            result = measure_attention(spec, T, args.repeats)
        print(json.dumps(result))
        return
    lengths = args.lengths or ([512, 1024] if args.quick else [2048, 4096, 8192, 16384])
    time_lengths = args.time_lengths or ([512] if args.quick else [4096, 16384])
    print(f"mid-size K3 + draft, fp32, B=1, K={LONG['K']}, one thread per process\n")
    if not args.time_only:
        print_memory(memory_table(lengths))
        print()
    if not args.memory_only:
        print_time(time_lengths, 1 if args.quick else args.repeats)


if __name__ == "__main__":
    main()
