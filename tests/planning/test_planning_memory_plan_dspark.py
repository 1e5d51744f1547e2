"""The memory plan of a DSpark run (``planning/dspark_plan.py``): its drafter step is a census of the real
step on the meta device (``planning/dspark_census.py``), checked here against the same step run for real on CPU
(every storage counted the same way), and the shipped K3 config's verdict at 64K tokens per row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_eagle.commands.memory_plan import main as memory_plan_main
from lightning_eagle.commands.memory_plan import run_config_from_yaml
from lightning_eagle.draft.dspark_config import dspark_config_from_preset
from lightning_eagle.draft.dspark_export import DSPARK
from lightning_eagle.planning import build_plan
from lightning_eagle.planning.dspark_census import dspark_step_census
from lightning_eagle.planning.dspark_plan import DSPARK_PHASES
from lightning_eagle.run_settings import TargetSettings
from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings

TINY = dspark_config_from_preset("k3-tiny")


@pytest.mark.parametrize(
    "draft, objective",
    [
        pytest.param(DSparkDraftSettings(block_chunk=3), DSparkObjectiveSettings(num_anchors=8, loss_backend="chunked",
                     loss_chunk=8), id="chunked-loss"),
        pytest.param(DSparkDraftSettings(block_chunk=None), DSparkObjectiveSettings(num_anchors=6, loss_backend="plain"
                     ),
                     id="plain-loss-one-call"),
        pytest.param(DSparkDraftSettings(block_chunk=2, activation_checkpointing=True, kv_cache="expanded"),
                     DSparkObjectiveSettings(num_anchors=8, loss_backend="chunked", loss_chunk=5), id="checkpointed"),
    ],
)  # fmt: skip
def test_the_meta_census_counts_what_the_real_step_allocates(draft, objective):
    options = dict(batch_size=2, seq_len=40, target_dtype=torch.float32, mla_backend="eager")
    meta = dspark_step_census(TINY, draft, objective, **options)
    real = dspark_step_census(TINY, draft, objective, device="cpu", **options)
    assert meta.kept_after_forward > 0 and meta.peak > meta.kept_after_forward
    assert meta.kept_after_forward == pytest.approx(real.kept_after_forward, rel=0.01)
    assert meta.peak == pytest.approx(real.peak, rel=0.01)


def test_checkpointing_and_the_chunked_loss_shrink_the_census():
    options = dict(batch_size=1, seq_len=96, target_dtype=torch.float32)
    objective = DSparkObjectiveSettings(num_anchors=16, loss_backend="chunked", loss_chunk=8)
    kept = dspark_step_census(TINY, DSparkDraftSettings(block_chunk=4), objective, **options)
    recomputed = dspark_step_census(TINY, DSparkDraftSettings(block_chunk=4, activation_checkpointing=True), objective,
                                    **options)  # fmt: skip
    assert recomputed.kept_after_forward < kept.kept_after_forward / 2
    plain = dspark_step_census(TINY, DSparkDraftSettings(block_chunk=4), dataclasses.replace(objective,
                               loss_backend="plain"), **options)  # fmt: skip
    assert plain.kept_after_forward > kept.kept_after_forward  # the plain twin keeps [N, V] fp32 softmaxes


def test_the_plan_of_a_dspark_config_names_its_phases_and_terms(tmp_path):
    run = run_config_from_yaml("quickstart_dspark", device="cuda")
    plan = build_plan(run.inputs)
    assert run.inputs.family == DSPARK and plan.peak_phase in DSPARK_PHASES
    names = {t.name for t in plan.terms}
    assert {"drafter activations kept for the backward", "backward working set", "target outputs (taps, final hidden)",
            "draft parameters", "AdamW states"} <= names  # fmt: skip
    census = run.inputs.draft_step
    assert plan.term("drafter activations kept for the backward").nbytes == census.kept_after_forward
    assert plan.phase_bytes("draft blocks") >= census.peak


@pytest.mark.slow
def test_kimi_k3_dspark_fits_on_80gb_at_64k_tokens_per_row(capsys):
    assert memory_plan_main(["--config", "kimi_k3_dspark", "--target-config", "k3", "--gpu-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 1 x 65536 tokens" in out and "world 64 (8 node(s) x 8 GPU(s))" in out
    assert out.strip().splitlines()[-1].startswith("fits: "), out


def test_dspark_plan_refusals(tmp_path, capsys):
    config = tmp_path / "sp.yaml"
    from lightning_eagle.configs import resolve_config_path

    text = open(resolve_config_path("quickstart_dspark")).read()
    config.write_text(text)
    assert memory_plan_main(["--config", str(config), "--device", "cpu"]) == 2
    assert "the DSpark plan counts CUDA's attention kernel only" in capsys.readouterr().err


def test_the_plan_refuses_dspark_sequence_parallelism_with_the_modules_words():
    from lightning_eagle.k3 import config_from_name
    from lightning_eagle.parallel.layout import ParallelLayout
    from lightning_eagle.planning import PlanInputs

    layout = ParallelLayout(world_size=2, draft_sequence_parallel_size=2)
    with pytest.raises(ValueError, match=r"draft_sequence_parallel_size=2 is not supported for a DSpark draft"):
        PlanInputs(target=config_from_name("k3-tiny"), draft=TINY, family=DSPARK, layout=layout,
                   target_settings=TargetSettings(), draft_settings=DSparkDraftSettings(),
                   objective=DSparkObjectiveSettings())  # fmt: skip
