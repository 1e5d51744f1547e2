"""``benchmarks/gpu_check.py`` at reduced size on CPU: every section runs, agrees, and lands in the JSON (so the
prepared GPU check does not rot between the rare runs on a GPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

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
