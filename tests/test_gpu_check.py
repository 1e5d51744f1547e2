"""``benchmarks/gpu_check.py`` at reduced size on CPU: every section runs, agrees, and lands in the JSON (so the
prepared GPU check does not rot between the rare runs on a GPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.slow
def test_reduced_cpu_run_has_every_section(gpu_check, tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert report["meta"]["reduced"] is True and report["meta"]["device"] == "cpu"
    assert list(report["sections"]) == list(gpu_check.SECTIONS) and report["failed"] == []
    assert report["complete"] is True and report["skipped"] == []
    assert list(report["meta"]["section_s"]) == list(gpu_check.SECTIONS)
    for name, rows in report["sections"].items():
        assert rows and f"## {name}" in printed, name
        assert not [r for r in rows if r.get("status") in ("FAIL", "error")], (name, rows)
    sections = report["sections"]

    kda = {r["backend"]: r for r in sections["kda_model"]}
    assert kda["chunk"]["status"] == "PASS" and kda["chunk"]["max_abs_diff_vs_naive"] <= kda["chunk"]["tolerance"]
    assert kda["fla"]["status"] == kda["fla_chunk"]["status"] == "CUDA only"

    golden = {r["dtype"]: r for r in sections["golden"]}
    assert golden["float32"]["status"] == "PASS" and golden["float32"]["relative_error"] < 1e-4
    assert golden["bfloat16"]["status"] == "PASS" and 0 < golden["bfloat16"]["layer0_relative_error"] < 3e-2

    layers = sections["layers"]
    assert {r["layer"].split(" (")[0] for r in layers} == {"KDA token mixer", "MLA token mixer", "routed experts"}
    for row in layers:
        assert row["status"] in ("ok", "skipped") and row.get("peak_mb", "n/a") == "n/a"
        if row["status"] == "ok":
            assert row["max_abs_diff"] < 5e-2, row  # bf16 twins

    attention = sections["ttt_attention"]
    assert {r["backend"] for r in attention} == {"flash_lse", "sdpa_mask", "flex_attention"}
    assert all(r["status"] == "PASS" for r in attention)
    flex = [r for r in attention if r["backend"] == "flex_attention"]
    assert flex and all(r["note"] == "backward refused on CPU (documented)" for r in flex)

    step = {r["backend"]: r for r in sections["ttt_step"]}
    assert list(step) == list(gpu_check.TTT_BACKENDS)
    assert step["flex_attention"]["status"] == "refused on CPU (documented)"
    for backend in ("eager", "flash_lse", "sdpa_mask"):
        row = step[backend]
        assert row["status"] == "ok" and row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["mfu"] == "n/a"
        assert row["model_tflop"] > 0 and row.get("loss_diff_vs_eager", 0.0) < 1e-3

    check_long_context_sections(sections, gpu_check.REDUCED)


LONG_SECTIONS = ("chunked_loss", "flash_lse_block", "latent_cache", "target_chunks", "long_context")
GRADIENT_LABEL = {"target_chunks": "later_taps_and_final"}  # the target is forward only: its other outputs


def check_long_context_sections(sections: dict, sizes) -> None:
    """Issue 21's paths: fp32 and bf16 agreement rows that passed with real (non-trivial) errors, cost rows with both
    paths timed (no allocator statistics on CPU)."""
    for name in LONG_SECTIONS:
        checks = [r for r in sections[name] if "check" in r]
        costs = [r for r in sections[name] if "check" not in r]
        assert checks and costs, name
        assert {r["dtype"] for r in checks} == {"float32", "bfloat16"} and all(r["status"] == "PASS" for r in checks)
        first, rest = ("layer0", GRADIENT_LABEL[name]) if name in GRADIENT_LABEL else ("out", "grad")
        for row in checks:
            # measured (latent step 0 runs the expanded path itself, so 0 there is exact)
            assert row[f"{first}_rel_err"] >= 0 and row[f"{rest}_rel_err"] >= 0, (name, row)
            if row["dtype"] == "float32":
                assert max(row[f"{first}_rel_err"], row[f"{rest}_rel_err"]) <= row["tolerance"] == 1e-4, (name, row)
            else:  # bf16 rounding shows, and the twin's own error sets the bound
                assert row[f"twin_{first}_rel_err"] > 0 and row[f"{first}_tolerance"] >= 2e-3, (name, row)
                assert row[f"{first}_rel_err"] <= row[f"{first}_tolerance"], (name, row)
        for row in costs if name != "long_context" else ():
            assert row["status"] == "ok" and row["ms"] > 0 and row["twin_ms"] > 0, (name, row)
            assert row["time_ratio"] == row["ms"] / row["twin_ms"] and "note" not in row, (name, row)
            assert row["peak_mb"] == row["peak_ratio"] == row["peak_total_mb"] == "n/a", (name, row)

    steps = sorted({0, 1, sizes.ttt_steps - 1})
    for name in ("flash_lse_block", "latent_cache"):
        assert sorted({r["step"] for r in sections[name] if "check" in r}) == steps, name
    assert all(r["block_rule"] == "CausalBlock" for r in sections["flash_lse_block"] if "check" in r)
    assert [r["T"] for r in sections["flash_lse_block"] if "check" not in r] == list(sizes.block_cost_seq_lens)
    (loss,) = [r for r in sections["chunked_loss"] if "check" not in r]
    assert loss["T"] == sizes.loss_seq_len and loss["supervised_share"] > 0.5  # supervise_most worked
    (latent,) = [r for r in sections["latent_cache"] if "check" not in r]
    assert latent["path"] == "latent cache" and 0 <= latent["loss_rel_diff"] < 1e-2
    target = [r for r in sections["target_chunks"] if "check" not in r]
    assert [r["T"] for r in target] == list(sizes.target_cost_seq_lens)
    assert all(r["path"] == f"token_chunk={sizes.target_chunk}" for r in target)
    long = [r for r in sections["long_context"] if "check" not in r]
    assert [r["T"] for r in long] == list(sizes.long_seq_lens)
    for row in long:
        assert row["status"] == "ok" and row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["loss"] > 0, row
        assert row["peak_mb"] == row["peak_total_mb"] == "n/a" and "peak_ratio_vs_prev" not in row  # CUDA only


def test_agreement_rows_fail_a_wrong_fast_path(gpu_check):
    """The verdicts themselves: exact → PASS; a 1e-3 error fails fp32 but is bf16 noise; a 5 % error in the output
    or in one gradient fails both; a wrong unjudged rest fails fp32 only."""
    base = [torch.sin(torch.arange(257.0) / 7), torch.cos(torch.arange(300.0) / 5), torch.arange(1.0, 9.0)]

    def run_with(out_error=0.0, grad_error=0.0):
        def run(dtype, path):
            out, *grads = [t.to(dtype) for t in base]
            if path == "fast":
                out, grads[-1] = out * (1 + out_error), grads[-1] * (1 + grad_error)
            return [out, *grads]

        return run

    def verdicts(**kwargs):
        judge = kwargs.pop("judge_rest_in_bf16", True)
        rows = gpu_check.agreement_rows("synthetic", run_with(**kwargs), judge_rest_in_bf16=judge)
        return [r["status"] for r in rows]

    assert verdicts() == ["PASS", "PASS"]
    assert verdicts(out_error=1e-3) == ["FAIL", "PASS"]
    assert verdicts(out_error=0.05) == ["FAIL", "FAIL"]
    assert verdicts(grad_error=0.05) == ["FAIL", "FAIL"]
    assert verdicts(grad_error=0.05, judge_rest_in_bf16=False) == ["FAIL", "PASS"]
    row32, row16 = gpu_check.agreement_rows("synthetic", run_with(grad_error=0.05))
    assert row32["grad_rel_err"] == pytest.approx(0.05, rel=1e-3) and row32["out_rel_err"] == 0
    assert row16["twin_out_rel_err"] > 0 and row16["out_tolerance"] == 2 * row16["twin_out_rel_err"] + 2e-3


def test_time_budget_skips_what_would_end_late(gpu_check, tmp_path):
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--out", str(out), "--sections", "ttt_attention", "long_context", "--budget-s", "1e-9"]
    assert gpu_check.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["skipped"] == ["ttt_attention", "long_context"] and report["failed"] == [] and report["complete"]
    assert all(r["status"] == "skipped (time budget)" for rows in report["sections"].values() for r in rows)

    now = time.perf_counter()
    assert gpu_check.predicted_past_deadline(None, (1024, 1000.0), 2048) is None  # no budget
    assert gpu_check.predicted_past_deadline(now + 60, None, 2048) is None  # the first length always runs
    assert gpu_check.predicted_past_deadline(now + 60, (1024, 1000.0), 2048) is None  # ~4 s of 60 left
    assert gpu_check.predicted_past_deadline(now + 60, (1024, 1000.0), 8192) == pytest.approx(64.0)


def test_flop_formula_counts_the_draft(gpu_check):
    """The MFU numerator: 3× the draft forward (matmul weights per step + attention) plus the teacher forward."""
    from draft_helpers import tiny_draft

    draft = tiny_draft()
    c = draft.config
    B, T, K, V, Ht = 1, 16, 2, c.vocab_size, c.target_hidden_size
    p_fc = draft.fc.weight.numel()
    linears = [m for m in draft.midlayer.modules() if m.__class__.__name__ == "Linear"]
    p_step = sum(m.weight.numel() for m in linears) + draft.lm_head.weight.numel()
    n, d = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim
    attention = sum(2 * n * d * ((T + 1) / 2 + k) for k in range(K))
    expected = B * T * (3 * (2 * (p_fc + K * p_step) + attention) + 2 * V * Ht)
    assert gpu_check.ttt_step_flops(draft, B, T, K, V, Ht) == pytest.approx(expected)


def test_full_sizes_are_the_k3_widths(gpu_check):
    """The GPU-only sizes cannot rot unseen: the attention inputs have the K3 draft's head widths, and the target
    slice builds (on the meta device) with K3's widths and one layer of each kind."""
    from lightning_eagle.draft import Eagle3DraftConfig
    from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name

    full = gpu_check.FULL
    draft = Eagle3DraftConfig.from_target_config(config_from_name(full.draft_preset), **full.draft_overrides)
    d_qk = draft.qk_nope_head_dim + draft.qk_rope_head_dim
    heads = {"n": draft.num_attention_heads, "d_qk": d_qk, "d_v": draft.v_head_dim}
    assert {k: full.block_attention[k] for k in heads} == heads == {"n": 96, "d_qk": 192, "d_v": 128}
    latent = {"n": draft.num_attention_heads, "nope": draft.qk_nope_head_dim, "rope": draft.qk_rope_head_dim}
    latent |= {"d_v": draft.v_head_dim, "r": draft.kv_lora_rank}
    assert {k: full.latent[k] for k in latent} == latent
    assert full.block_attention["T"] % full.block_chunk and full.latent["T"] % full.latent_chunk  # ragged last chunk

    config = config_from_name(full.target_preset, **full.target_overrides)
    k3 = config_from_name("k3")
    assert (config.hidden_size, config.moe_intermediate_size) == (k3.hidden_size, k3.moe_intermediate_size)
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    kinds = [(type(layer.self_attn).__name__, hasattr(layer, "block_sparse_moe")) for layer in model.model.layers]
    assert kinds == [("KimiDeltaAttention", False), ("NoPEMLA", True)]
    assert full.target_check["T"] % full.target_check["chunk"] and max(full.long_seq_lens) == 65536


def test_a_section_fails_a_broken_fast_path(gpu_check, monkeypatch):
    """End to end: flash_lse with a block rule that forgets the padding (padding queries then see keys 1..t) must
    fail its section in fp32 and in bf16, while the rule is still the tensor-free one."""
    from lightning_eagle.draft import ttt_attention
    from lightning_eagle.draft.block_attention import CausalBlock

    monkeypatch.setattr(ttt_attention, "step_zero_rule", lambda cache, q: CausalBlock(lengths=None))
    rows = gpu_check.section_flash_lse_block(torch.device("cpu"), gpu_check.REDUCED)
    checks = [r for r in rows if "check" in r]
    assert checks and all(r["status"] == "FAIL" and r["block_rule"] == "CausalBlock" for r in checks)
    assert min(r["out_rel_err"] for r in checks) > 1e-2


def test_dspark_vllm_section_on_cpu(gpu_check):
    """The DSpark comparison's plumbing on CPU: our own bf16 captures pass, the engine row says CUDA only, and a
    perturbed output or a wrong layout fails."""
    rows = gpu_check.section_dspark_vllm(torch.device("cpu"), None)
    own, engine = rows[:-1], rows[-1]
    assert len(own) == len(gpu_check.DSPARK_PROMPTS) and engine["status"] == "CUDA only"
    for row in own:
        assert row["status"] == "PASS" and row["layout_ok"] is True, row
        assert 0 < row["block_rel_err"] <= row["tolerance"] and 0 < row["combine_rel_err"] <= row["tolerance"]
    drafter, embed = gpu_check.dspark_drafter_and_embedding()
    captures = gpu_check.dspark_own_captures(drafter, embed, gpu_check.DSPARK_PROMPTS[:1])
    broken = dict(captures)
    broken["0.block.out"] = captures["0.block.out"].flip(0)  # the slots in the wrong order
    assert gpu_check.dspark_compare_rows(drafter, embed, broken, 1, "broken")[0]["status"] == "FAIL"
    shifted = dict(captures)
    shifted["0.block.positions"] = captures["0.block.positions"] + 1  # not anchored right after the context
    row = gpu_check.dspark_compare_rows(drafter, embed, shifted, 1, "shifted")[0]
    assert row["status"] == "FAIL" and row["layout_ok"] is False
    missing = {k: v for k, v in captures.items() if not k.startswith("0.block")}
    assert gpu_check.dspark_compare_rows(drafter, embed, missing, 1, "missing")[0]["status"] == "FAIL"


def test_engine_features_section_on_cpu(gpu_check, tmp_path):
    """The engine-features comparison on CPU: our own engine twin's files pass in both streams (and under stream 0,
    id L is reported as not the model's output), the engine row says CUDA only, and ids one layer off (id k read as
    layer k's output) fail."""
    rows = gpu_check.section_engine_features(torch.device("cpu"), None)
    own, engine = rows[:-1], rows[-1]
    assert engine["status"] == "CUDA only"
    checked = [r for r in own if r["status"] in ("PASS", "FAIL")]
    assert [(r["stream"], r["id"]) for r in checked] == [(s, i) for s in ("prefix", "mixed") for i in (1, 3, 5, 6)]
    assert all(r["status"] == "PASS" for r in checked), checked
    (output,) = [r for r in own if r["reads"] == "vs the model's pre-norm output"]  # our prefix id L, like vLLM 0.32's
    assert output["stream"] == "prefix" and output["status"].startswith("differs") and output["rel_err"] > 0.1

    from lightning_eagle.features.own_engine import OwnTargetEngine
    from lightning_eagle.k3.model import KimiK3ForCausalLM

    model = KimiK3ForCausalLM.from_pretrained("quickstart", dtype=torch.float32).eval()

    class Shifted(OwnTargetEngine):  # writes ids 2 and 4 where 1 and 3 are asked
        def write(self, prompt):
            self.ids = [2, 4, 5, 6]
            try:
                return super().write(prompt)
            finally:
                self.ids = [1, 3, 5, 6]

    shifted = gpu_check.engine_feature_rows(model, Shifted(model, [1, 3, 5, 6], tmp_path), [1, 3, 5, 6], "mixed",
                                            "shifted", tol=1e-6)  # fmt: skip
    assert [r["status"] for r in shifted] == ["FAIL", "FAIL", "PASS", "PASS"]
