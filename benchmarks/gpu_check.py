"""One prepared device check of the hot paths (issue 12): each fast path against its twin, for agreement and cost.

    python benchmarks/gpu_check.py                    # CUDA when present (sized for < 8 min on one H200)
    python benchmarks/gpu_check.py --device cpu       # reduced sizes (implied on CPU; tests/test_gpu_check.py)
    python benchmarks/gpu_check.py --out result.json --sections ttt_step

Prints one markdown table per section and writes everything as JSON to ``--out`` (default ``gpu_check.json``).

Sections:

* ``kda_model`` — k3-tiny whole model (fp32, TF32 off), logits of every KDA backend vs the naive twin: max |Δ| and
  PASS/FAIL with the tolerance of :mod:`lightning_eagle.k3.kda_compare` (fla kernels: a "not installed" row without
  flash-linear-attention). It does not write the check record that ``backend="auto"`` consults; run
  ``python -m lightning_eagle.commands.check_kda`` for that.
* ``golden`` — the vendored golden target (``tests/golden/target``) loaded through the real loader in fp32 and in
  bf16, per KDA backend, vs the golden fp32 logits at real tokens: relative error ``‖Δ‖₂/‖ref‖₂``, max |Δ|, argmax
  agreement, layer 0's relative error and the share of router flips per MoE layer. fp32 must meet the golden README
  tolerance (atol 2e-4 + rtol 1e-4). bf16 is judged on layer 0 (≤ 3e-2): the tiny golden's router margins (~1e-4)
  make bf16 flip expert choices, so its logits legitimately diverge (see :func:`section_golden`).
* ``layers`` — one K3-width piece of each layer kind at T = 4096 in bf16, forward (the target is frozen), new path
  vs twin: the KDA token mixer (chunked torch / fla vs per-token naive), the MLA token mixer
  (``mla_backend="sdpa"`` vs ``"eager"``) and the routed experts of one expert-parallel rank (14 local
  experts of 896 at EP 64, dequantized bf16 and MXFP4 storage; grouped ``forward`` vs the ``forward_naive`` loop).
  The rank receives as many (token, expert) pairs as it sends under balanced routing, ``T·top_k`` = 65536 rows,
  each routed to one uniformly drawn local expert.
* ``ttt_attention`` — every TTT attention backend vs eager on small fp32 inputs with the draft's real head widths
  (d_qk 192, d_v 128), a padded row and T not a multiple of the 128-wide flex tiles: forward and the gradients of q
  and every cached K/V. flex on CPU: forward only, its documented refusal of gradients is checked instead.
* ``ttt_step`` — one TTT training step (``ttt_loss`` forward + backward, K = 7, bf16, B = 1, T = 4096) of the K3 draft
  (H 7168, 96 heads, q_lora 1536, kv_lora 512, SiTU MLP 33792, draft vocab 32000) with the chunked teacher from a
  163840 × 7168 ``lm_head``, per TTT attention backend: step time, tokens/s, model FLOP utilisation, peak memory and
  the loss difference to eager.

Model FLOPs of a step (the MFU numerator; B·T tokens, padding included since it is computed):

    per token, forward:  2·(P_fc + K·P_step) + Σ_{k<K} 2·n·(d_qk + d_v)·((T+1)/2 + k)
    step:                B·T·(3·forward + 2·V·H_t)

``P_fc`` = the ``fc`` weights, ``P_step`` = the draft layer's matmul weights + the draft ``lm_head`` (norms and
embedding lookups are not FLOPs), the attention term counts the causal block's average (T+1)/2 keys plus k diagonal
columns; training = forward + 2× forward for the backward; the teacher is forward only over the full vocabulary
(``V·H_t`` MACs per token). MFU = model FLOPs / step time / ``--peak-tflops`` (default 989 = H100/H200 SXM dense bf16).

Measurements: the best of ``--repeats`` timed calls after one warm-up call (which also compiles flex). CUDA peak
memory is ``torch.cuda.max_memory_allocated`` during the timed calls minus what was allocated before them (the
call's own transient + outputs); on CPU it is "n/a" (no allocator statistics; ``benchmarks/ttt_step.py`` measures
RSS in isolated processes). Exit status: 1 when any agreement check failed or a new path raised, else 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
GOLDEN_TARGET = REPO_ROOT / "tests" / "golden" / "target"
SECTIONS = ("kda_model", "golden", "layers", "ttt_attention", "ttt_step")
TTT_BACKENDS = ("eager", "flash_lse", "sdpa_mask", "flex_attention")
FLA_BACKENDS = ("fla", "fla_chunk")


@dataclass
class Sizes:
    kda_seq_len: int  # kda_model
    layer_preset: str  # layers: a K3 preset name
    layer_seq_len: int
    local_experts: int
    attention: dict  # ttt_attention: B, n, T, d_qk, d_v, steps
    draft_preset: str  # ttt_step: the target preset the draft is derived from
    draft_overrides: dict = field(default_factory=dict)
    ttt_seq_len: int = 4096
    ttt_steps: int = 7
    repeats: int = 3


FULL = Sizes(
    kda_seq_len=512,
    layer_preset="k3",
    layer_seq_len=4096,
    local_experts=14,  # 896 experts / EP 64
    attention={"B": 2, "n": 4, "T": 200, "d_qk": 192, "d_v": 128, "steps": 3},
    draft_preset="k3",
    draft_overrides={"draft_vocab_size": 32000},
    ttt_seq_len=4096,
    ttt_steps=7,
    repeats=3,
)
REDUCED = Sizes(
    kda_seq_len=48,
    layer_preset="k3-tiny",
    layer_seq_len=128,
    local_experts=4,  # of k3-tiny's 8
    attention={"B": 2, "n": 2, "T": 40, "d_qk": 24, "d_v": 16, "steps": 2},
    draft_preset="k3-tiny",
    draft_overrides={"draft_vocab_size": 72, "aux_layer_ids": [1, 3, 5]},
    ttt_seq_len=128,
    ttt_steps=2,
    repeats=1,
)


# ---- measuring ------------------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[object, float, float | str]:
    """``(output of the warm-up call, best ms of the timed calls, peak MB of the timed calls or "n/a")``."""
    out = fn()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # the result is dropped at once: the peak is one call's transient plus its output
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else "n/a"
    return out, 1000 * min(times), peak


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def fla_installed(device: torch.device) -> bool:
    from lightning_eagle.k3.kda_ops import fla_kda_available

    return fla_kda_available(device)


# ---- (a) KDA: the whole k3-tiny model ------------------------------------------------------------------------------
def section_kda_model(device: torch.device, sizes: Sizes) -> list[dict]:
    from lightning_eagle.k3.kda_compare import compare_kda_backends

    installed = fla_installed(device)
    backends = ["chunk", *FLA_BACKENDS] if installed else ["chunk"]
    rows = []
    for r in compare_kda_backends(device, backends, seq_len=sizes.kda_seq_len):
        rows.append(
            {
                "backend": r.backend,
                "max_abs_diff_vs_naive": r.max_abs_diff,
                "tolerance": r.tolerance,
                "status": "PASS" if r.passed else "FAIL",
                "note": r.error or "",
            }
        )
    if not installed:
        why = "not installed" if device.type == "cuda" else "CUDA only"
        rows += [{"backend": b, "status": why, "note": "flash-linear-attention"} for b in FLA_BACKENDS]
    return rows


# ---- (b) the golden target in bf16 ---------------------------------------------------------------------------------
GOLDEN_BF16_LAYER0_RTOL = 3e-2  # layer 0 (KDA + dense FFN, no routing): a few bf16 roundings of ~0.4 % each


def section_golden(device: torch.device, sizes: Sizes, golden: Path = GOLDEN_TARGET) -> list[dict]:
    """Logits vs the fp32 golden at real tokens. In bf16 the whole-model error is dominated by router flips — the
    golden's smallest top-k margins are ~1e-4, so bf16 activations flip a growing share of expert choices layer after
    layer and the logits diverge from the fp32 golden by tens of percent with no bug anywhere — so the bf16 verdict
    rests on layer 0's output (before any routing), and the flip shares per MoE layer are reported beside it."""
    from safetensors.torch import load_file

    from lightning_eagle import KimiK3ForCausalLM

    inputs = load_file(str(golden / "inputs.safetensors"))
    expected = load_file(str(golden / "expected.safetensors"))
    valid = inputs["attention_mask"].bool().to(device)
    reference = expected["logits"].to(device)[valid]
    backends = ["chunk", *FLA_BACKENDS] if fla_installed(device) else ["chunk"]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for backend in backends:
            row = {"dtype": str(dtype).removeprefix("torch."), "kda_backend": backend}
            try:
                model = KimiK3ForCausalLM.from_pretrained(golden, dtype=dtype, device=device, kda_backend=backend)
                row.update(golden_errors(model, inputs, expected, valid, reference, device))
                within_fp32_tolerance = row.pop("within_fp32_tolerance")
                if dtype == torch.float32:  # the golden README's tolerance for an fp32 implementation
                    ok = within_fp32_tolerance
                else:
                    layer0_ok = row["layer0_relative_error"] <= GOLDEN_BF16_LAYER0_RTOL
                    ok = math.isfinite(row["relative_error"]) and layer0_ok
                row["status"] = "PASS" if ok else "FAIL"
            except Exception as error:
                row.update(status="error", note=error_text(error))
            rows.append(row)
    return rows


def golden_errors(model, inputs, expected, valid, reference, device) -> dict:
    layer0 = {}
    handle = model.model.layers[0].register_forward_hook(lambda m, a, o: layer0.__setitem__("out", o[0]))
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer, "block_sparse_moe")]
    for i in moe_layers:
        model.model.layers[i].block_sparse_moe.record_routing = True
    try:
        with torch.no_grad():
            logits = model(inputs["input_ids"].to(device), inputs["attention_mask"].to(device)).logits
    finally:
        handle.remove()
    got = logits[valid].float()
    diff = got - reference
    want0 = expected["layer_out.0"].to(device)[valid]
    flat_valid = valid.reshape(-1)
    flips = []
    for i in moe_layers:
        idx = model.model.layers[i].block_sparse_moe.last_routing[0][flat_valid].sort(-1).values
        ref_idx = expected[f"router.{i}.topk_idx"].to(device)[flat_valid].sort(-1).values
        flips.append(round((idx != ref_idx).any(-1).float().mean().item(), 3))
    return {
        "relative_error": (diff.norm() / reference.norm()).item(),
        "max_abs_diff": diff.abs().max().item(),
        "argmax_agreement": (got.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "layer0_relative_error": ((layer0["out"][valid].float() - want0).norm() / want0.norm()).item(),
        "router_flips_by_layer": flips,
        "within_fp32_tolerance": bool((diff.abs() <= 2e-4 + 1e-4 * reference.abs()).all()),
    }


# ---- (c) one K3-width piece of each layer kind ---------------------------------------------------------------------
def keep_fp32_islands(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast to ``dtype`` except the spec's fp32 parameters (``A_log``, ``dt_bias``, …), as the target loader does."""
    from lightning_eagle.k3.fp32_parameters import is_fp32_parameter

    for name, p in module.named_parameters():
        if p.is_floating_point() and not is_fp32_parameter(name):
            p.data = p.data.to(dtype)
    return module


def compare_paths(name: str, new: str, twin: str, run_new, run_twin, device, repeats) -> dict:
    """Time both paths and compare their outputs; a twin that runs out of memory is reported, not fatal."""
    row = {"layer": name, "path": new, "twin": twin}
    try:
        out_new, row["ms"], row["peak_mb"] = measure(run_new, device, repeats)
    except Exception as error:
        release(device)
        return {**row, "status": "error", "note": error_text(error)}
    try:
        out_twin, row["twin_ms"], row["twin_peak_mb"] = measure(run_twin, device, repeats)
        row["speedup"] = row["twin_ms"] / row["ms"]
        row["max_abs_diff"] = max_abs_diff(out_new, out_twin)
        row["status"] = "ok"
    except Exception as error:
        row.update(status="ok", note=("twin OOM: " if is_oom(error) else "twin failed: ") + error_text(error))
    del out_new
    release(device)
    return row


def section_layers(device: torch.device, sizes: Sizes) -> list[dict]:
    from lightning_eagle.k3 import config_from_name

    config = config_from_name(sizes.layer_preset)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, sizes.layer_seq_len, config.hidden_size, device=device, dtype=torch.bfloat16, generator=g)
    with torch.no_grad():  # the target is frozen: forward only
        rows = kda_rows(config, x, device, sizes.repeats)
        rows += mla_rows(config, x, device, sizes.repeats)
        rows += expert_rows(config, sizes, g, device)
    return rows


def kda_rows(config, x: torch.Tensor, device: torch.device, repeats: int) -> list[dict]:
    """KDA token mixer: chunked torch (and fla where installed) vs the per-token recurrence."""
    from lightning_eagle.k3.kda import KimiDeltaAttention

    with torch.device(device):
        kda = keep_fp32_islands(KimiDeltaAttention(config), x.dtype)
    rows = []
    for backend in ["chunk", *(FLA_BACKENDS if fla_installed(device) else ())]:
        rows.append(
            compare_paths(
                "KDA token mixer", backend, "naive",
                lambda b=backend: kda(x, backend=b), lambda: kda(x, backend="naive"), device, repeats,
            )
        )  # fmt: skip
    return rows


def mla_rows(config, x: torch.Tensor, device: torch.device, repeats: int) -> list[dict]:
    """MLA token mixer: the SDPA core vs the eager fp32-scores core (same projections, same weights)."""
    from lightning_eagle.k3.layer import build_mla

    with torch.device(device):
        mla = build_mla(config).to(x.dtype)
    if not hasattr(mla, "mla_backend"):
        note = "NoPEMLA.mla_backend is missing (lightning_eagle/ops/mla.py)"
        return [{"layer": "MLA token mixer", "path": "sdpa", "twin": "eager", "status": "skipped", "note": note}]

    def run(implementation: str) -> torch.Tensor:
        mla.mla_backend = implementation
        return mla(x)

    row = compare_paths("MLA token mixer", "sdpa", "eager", lambda: run("sdpa"), lambda: run("eager"), device, repeats)
    return [row]


def expert_rows(config, sizes: Sizes, g: torch.Generator, device: torch.device) -> list[dict]:
    """Routed experts of one EP rank: ``local`` experts, ``T·top_k`` received rows, one local expert each."""
    from lightning_eagle.k3.experts import RoutedExperts

    dtype, local = torch.bfloat16, min(sizes.local_experts, config.num_experts)
    n_rows = sizes.layer_seq_len * config.num_experts_per_token
    Hl, inter = config.expert_hidden_size, config.moe_intermediate_size
    z = torch.randn(n_rows, Hl, device=device, dtype=dtype, generator=g)
    topk_idx = torch.randint(0, local, (n_rows, 1), device=device, generator=g)
    topk_weight = torch.rand(n_rows, 1, device=device, generator=g)
    betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
    rows = []
    for storage in ("dequantized", "mxfp4"):
        name = f"routed experts ({local} local, {n_rows} rows, {storage})"
        with torch.device(device):
            experts = RoutedExperts(config.num_experts, Hl, inter, (0, local), *betas, storage=storage)
        random_expert_weights(experts, dtype, g)
        path = "grouped"
        if hasattr(experts, "resolve_backend"):  # which grouped kernel ran (grouped_mm or padded bmm)
            path = f"grouped ({experts.resolve_backend(z, *experts.stacked_weights(dtype))})"
        rows.append(
            compare_paths(
                name, path, "per-expert loop",
                lambda e=experts: e(z, topk_idx, topk_weight),
                lambda e=experts: e.forward_naive(z, topk_idx, topk_weight),
                device, sizes.repeats,
            )
        )  # fmt: skip
    return rows


def random_expert_weights(experts, dtype: torch.dtype, g: torch.Generator) -> None:
    """Scaled normal bf16 weights, or random MXFP4 codes with E8M0 scales 2^-9 … 2^-4 (|w| ≤ 6·2^-4)."""
    with torch.no_grad():
        if experts.storage == "dequantized":
            for p in (experts.gate_up_proj, experts.down_proj):
                p.data = (torch.randn(p.shape, device=p.device, generator=g) / math.sqrt(p.shape[1])).to(dtype)
            return
        for name in ("gate_up_packed", "down_packed"):
            buf = getattr(experts, name)
            buf.copy_(torch.randint(0, 256, buf.shape, device=buf.device, generator=g, dtype=torch.int32))
        for name in ("gate_up_scale", "down_scale"):
            buf = getattr(experts, name)
            buf.copy_(torch.randint(118, 124, buf.shape, device=buf.device, generator=g, dtype=torch.int32))


# ---- (d) TTT attention agreement -----------------------------------------------------------------------------------
AGREEMENT_TOLERANCE = 5e-3  # fp32 inputs of unit scale; a mask or merge error moves outputs by O(0.1)


def attention_inputs(device: torch.device, B, n, T, d_qk, d_v, steps, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, device=device, generator=g).requires_grad_()

    q = leaf(B, n, T, d_qk)
    keys = [leaf(B, n, T, d_qk) for _ in range(steps + 1)]
    values = [leaf(B, n, T, d_v) for _ in range(steps + 1)]
    mask = torch.ones(B, T, dtype=torch.long, device=device)
    mask[-1, T - T // 5 :] = 0  # a right-padded row
    weight = torch.randn(B, n, T, d_v, device=device, generator=g)
    return q, keys, values, mask, weight


def run_attention(fn, q, keys, values, mask, weight, scale, with_grad=True):
    from lightning_eagle.draft import TTTCache

    cache = TTTCache()
    cache.bind_mask(mask)
    for k, v in zip(keys, values):
        cache.append(k, v)
    if not with_grad:
        with torch.no_grad():
            return fn(q, cache, scale), None
    out = fn(q, cache, scale)
    return out.detach(), torch.autograd.grad((out * weight).sum(), [q, *keys, *values])


def section_ttt_attention(device: torch.device, sizes: Sizes) -> list[dict]:
    from lightning_eagle.draft.ttt_attention import FLEX_CPU_REFUSAL, get_ttt_attention
    from lightning_eagle.k3.kda_compare import full_fp32

    dims = dict(sizes.attention)
    steps = dims.pop("steps")
    scale = dims["d_qk"] ** -0.5
    rows = []
    with full_fp32():
        for k in range(steps + 1):
            inputs = attention_inputs(device, **dims, steps=k)
            ref_out, ref_grads = run_attention(get_ttt_attention("eager"), *inputs, scale)
            for backend in TTT_BACKENDS[1:]:
                row = {"backend": backend, "step": k, "dtype": "float32", "T": dims["T"]}
                fn = get_ttt_attention(backend)
                try:
                    if backend == "flex_attention" and device.type != "cuda":
                        # No flex backward on CPU (torch 2.13): compare the forward, assert the documented refusal.
                        out, _ = run_attention(fn, *inputs, scale, with_grad=False)
                        row["max_out_diff"] = max_abs_diff(out, ref_out)
                        try:
                            run_attention(fn, *inputs, scale)
                            refused = False
                        except NotImplementedError as error:
                            refused = str(error) == FLEX_CPU_REFUSAL
                        row["note"] = "backward refused on CPU (documented)" if refused else "backward NOT refused"
                        ok = refused and row["max_out_diff"] <= AGREEMENT_TOLERANCE
                    else:
                        out, grads = run_attention(fn, *inputs, scale)
                        row["max_out_diff"] = max_abs_diff(out, ref_out)
                        row["max_grad_diff"] = max(max_abs_diff(a, b) for a, b in zip(grads, ref_grads))
                        ok = max(row["max_out_diff"], row["max_grad_diff"]) <= AGREEMENT_TOLERANCE
                    row["status"] = "PASS" if ok else "FAIL"
                except Exception as error:
                    row.update(status="error", note=error_text(error))
                rows.append(row)
    return rows


# ---- (e) the draft's TTT training step ---------------------------------------------------------------------------
def ttt_step_flops(draft, B: int, T: int, K: int, target_vocab: int, target_hidden: int) -> float:
    """The model FLOPs of one step (formula in the module docstring)."""
    from torch import nn

    c = draft.config
    p_fc = draft.fc.weight.numel()
    p_step = sum(m.weight.numel() for m in draft.midlayer.modules() if isinstance(m, nn.Linear))
    p_step += draft.lm_head.weight.numel()
    d_qk, d_v, n = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.num_attention_heads
    forward = 2 * (p_fc + K * p_step) + sum(2 * n * (d_qk + d_v) * ((T + 1) / 2 + k) for k in range(K))
    return B * T * (3 * forward + 2 * target_vocab * target_hidden)


def build_ttt_step(device: torch.device, sizes: Sizes):
    """The draft (bf16) and one post-shift batch with the target's final hidden and lm_head (the chunked teacher)."""
    from lightning_eagle.draft import Eagle3DraftConfig, build_draft
    from lightning_eagle.k3 import config_from_name

    target = config_from_name(sizes.draft_preset)
    config = Eagle3DraftConfig.from_target_config(target, **sizes.draft_overrides)
    torch.manual_seed(0)
    with torch.device(device):
        draft = build_draft(config).to(torch.bfloat16)
    B, T, V, Ht = 1, sizes.ttt_seq_len, target.vocab_size, target.hidden_size
    g = torch.Generator(device=device).manual_seed(0)
    attention_mask = torch.ones(B, T, dtype=torch.long, device=device)
    attention_mask[:, T - T // 16 :] = 0  # some right padding
    batch = {
        "input_ids": torch.randint(0, V, (B, T), device=device, generator=g),
        "attention_mask": attention_mask,
        "loss_mask": attention_mask.clone(),
        "aux_hidden_states": torch.randn(B, T, 3 * Ht, device=device, generator=g, dtype=torch.bfloat16),
        "final_hidden": torch.randn(B, T, Ht, device=device, generator=g, dtype=torch.bfloat16),
        "lm_head_weight": (0.02 * torch.randn(V, Ht, device=device, generator=g)).to(torch.bfloat16),
    }
    return draft, batch, ttt_step_flops(draft, B, T, sizes.ttt_steps, V, Ht)


def section_ttt_step(device: torch.device, sizes: Sizes, peak_tflops: float | None) -> list[dict]:
    from lightning_eagle.draft.ttt_attention import FLEX_CPU_REFUSAL
    from lightning_eagle.training import ttt_loss

    draft, batch, flops = build_ttt_step(device, sizes)
    tokens = batch["input_ids"].numel()

    def step() -> torch.Tensor:
        draft.zero_grad(set_to_none=True)
        out = ttt_loss(draft, **batch, ttt_steps=sizes.ttt_steps)
        out.loss.backward()
        return out.loss.detach().float()

    rows, eager_loss = [], None
    for backend in TTT_BACKENDS:
        row = {"backend": backend, "T": sizes.ttt_seq_len, "K": sizes.ttt_steps, "model_tflop": flops / 1e12}
        draft.attention_backend = backend
        try:
            loss, ms, peak = measure(step, device, sizes.repeats)
            row.update(step_ms=ms, tokens_per_s=tokens / (ms / 1000), peak_mb=peak, loss=loss.item())
            row["mfu"] = flops / (ms / 1000) / (peak_tflops * 1e12) if peak_tflops else "n/a"
            if backend == "eager":
                eager_loss = loss.item()
            elif eager_loss is not None:
                row["loss_diff_vs_eager"] = abs(loss.item() - eager_loss)
            row["status"] = "ok"
        except NotImplementedError as error:
            expected = backend == "flex_attention" and device.type != "cuda" and str(error) == FLEX_CPU_REFUSAL
            row.update(status="refused on CPU (documented)" if expected else "error", note=error_text(error))
        except Exception as error:
            row.update(status="OOM" if is_oom(error) else "error", note=error_text(error))
        draft.zero_grad(set_to_none=True)
        release(device)
        rows.append(row)
    return rows


# ---- driver ---------------------------------------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def run_section(name: str, device: torch.device, sizes: Sizes, args) -> list[dict]:
    if name == "kda_model":
        return section_kda_model(device, sizes)
    if name == "golden":
        return section_golden(device, sizes, Path(args.golden))
    if name == "layers":
        return section_layers(device, sizes)
    if name == "ttt_attention":
        return section_ttt_attention(device, sizes)
    return section_ttt_step(device, sizes, args.peak_tflops)


def failed(rows: list[dict]) -> bool:
    return any(row.get("status") in ("FAIL", "error") for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reduced", action="store_true", help="tiny sizes (implied on CPU)")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--golden", default=str(GOLDEN_TARGET))
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (CUDA default: 989)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    reduced = args.reduced or device.type != "cuda"
    sizes = REDUCED if reduced else FULL
    if args.repeats is not None:
        sizes = replace(sizes, repeats=args.repeats)
    if args.peak_tflops is None and device.type == "cuda":
        args.peak_tflops = 989.0
    if device.type != "cuda":  # the CPU flex rows are unfused on purpose (forward-only check); on CUDA keep the warning
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    from lightning_eagle.k3.kda_records import device_class

    report = {
        "meta": {
            **device_class(device),
            "reduced": reduced,
            "sizes": asdict(sizes),
            "peak_tflops": args.peak_tflops,
            "flop_formula": "B*T*(3*(2*(P_fc+K*P_step) + sum_k 2*n*(d_qk+d_v)*((T+1)/2+k)) + 2*V*H_t)",
        },
        "sections": {},
    }
    print(f"gpu_check on {device} ({report['meta']['device']}), torch {torch.__version__}, reduced={reduced}")
    started = time.perf_counter()
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            rows = run_section(name, device, sizes, args)
        except Exception as error:  # one broken section must not hide the others
            traceback.print_exc()
            rows = [{"status": "error", "note": error_text(error)}]
        release(device)
        report["sections"][name] = rows
        print(f"\n## {name} ({time.perf_counter() - t0:.1f} s)\n\n{format_table(rows)}", flush=True)
    report["meta"]["elapsed_s"] = time.perf_counter() - started
    report["failed"] = [name for name, rows in report["sections"].items() if failed(rows)]
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\nwrote {args.out} in {report['meta']['elapsed_s']:.1f} s; failed sections: {report['failed'] or 'none'}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
