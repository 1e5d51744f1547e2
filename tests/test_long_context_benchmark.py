"""``benchmarks/long_context.py`` at a toy length in this process: its step (every long-context mechanism on), its
TTT attention timing and its plan inputs run, so the benchmark cannot rot between its (long) runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py"


def _load():
    spec = importlib.util.spec_from_file_location("long_context_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_benchmark_step_and_plan_run_at_a_toy_length():
    from lightning_eagle.planning import build_plan

    bench = _load()
    for spec in (bench.TODAY, bench.LONG):
        step = bench.build({**spec, "K": 2}, 64)
        step(48)  # a length the chunks (1024 tokens) do not divide: one partial segment
        plan = build_plan(bench.plan_inputs(spec, 4096))
        assert plan.phase_bytes(plan.peak_phase) > 0
    assert bench.measure_attention({**bench.LONG, "K": 2}, 64, repeats=1)["s"] > 0
    long_plan = build_plan(bench.plan_inputs(bench.LONG, 16384))
    today_plan = build_plan(bench.plan_inputs(bench.TODAY, 16384))
    assert long_plan.peak_bytes < today_plan.peak_bytes  # the mechanisms are what the LONG column measures
