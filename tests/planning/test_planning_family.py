"""The memory plan's family seam: a family registered entirely inside this test (a draft record and a planning record,
no library file touched) is planned, fitted and printed through its records; the shipped families are looked up by
name, never named by the shared plan."""

from __future__ import annotations

import pytest

from lightning_eagle.draft.family import DraftFamily, register_draft_family, unregister_draft_family
from lightning_eagle.k3 import config_from_name
from lightning_eagle.parallel.layout import ParallelLayout
from lightning_eagle.planning import (
    OPTIMIZER_STEP,
    RESIDENT,
    TARGET_FORWARD,
    DraftShapes,
    PlanInputs,
    PlanningFamily,
    Term,
    build_plan,
    format_plan,
    plan_header,
    planning_family,
    register_planning_family,
    smallest_fit,
)
from lightning_eagle.planning.family import unregister_planning_family
from lightning_eagle.run_settings import DraftSettings, ObjectiveSettings, TargetSettings

TOY = "toy-planning-family"
TOY_STEP = "toy step"


def _refuse_cpu(inputs: PlanInputs) -> None:
    if inputs.device == "cpu":
        raise ValueError("--device cpu: the toy plan counts CUDA only")


@pytest.fixture
def toy_family():
    register_draft_family(DraftFamily(
        name=TOY, config_type=dict, is_draft=lambda draft: False, recognizes=lambda config_json: False,
        load_export=lambda *args: None, export=lambda *args, **kwargs: None, serve_lines=lambda *args: [],
        aux_layer_ids=lambda config: config["taps"],
    ))  # fmt: skip
    register_planning_family(PlanningFamily(
        name=TOY, phases=(TARGET_FORWARD, TOY_STEP, OPTIMIZER_STEP),
        draft_shapes=lambda config: DraftShapes(trainable=config["params"], frozen=0, buffer_bytes=0,
                                                largest_trainable=config["params"], projection=0, groups=()),
        check=_refuse_cpu,
        step_terms=lambda inputs, target, draft: [
            Term(RESIDENT, "toy table", 1000), Term(TOY_STEP, "toy activations", inputs.batch_size * 10**9)],
        describe=lambda inputs: f"toy drafter, micro-batch {inputs.batch_size}",
    ))  # fmt: skip
    yield
    unregister_planning_family(TOY)
    unregister_draft_family(TOY)


def _toy_inputs(**changes) -> PlanInputs:
    values = dict(target=config_from_name("k3-tiny"), draft={"params": 1000, "taps": [1, 2]}, family=TOY,
                  target_settings=TargetSettings(), draft_settings=DraftSettings(), objective=ObjectiveSettings(),
                  layout=ParallelLayout(world_size=1))  # fmt: skip
    return PlanInputs(**{**values, **changes})


def test_a_family_defined_in_a_test_is_planned_through_its_records(toy_family):
    inputs = _toy_inputs(batch_size=3)
    plan = build_plan(inputs)
    assert inputs.phases == (TARGET_FORWARD, TOY_STEP, OPTIMIZER_STEP) and inputs.aux_layer_ids == (
        1,
        2,
    )  # the draft record's
    assert plan.peak_phase == TOY_STEP and plan.term("toy activations").nbytes == 3 * 10**9
    assert plan.term("toy table").phase == RESIDENT and plan.term("draft parameters").nbytes == 1000 * 4
    table = format_plan(plan)
    assert "toy step total (on top of resident)" in table and "teacher" not in table
    assert "toy drafter, micro-batch 3" in plan_header(inputs, 1, 1, "k3-tiny")
    fit = smallest_fit(_toy_inputs(batch_size=3), gpu_bytes=10**10, gpus_per_node=1, max_nodes=1)
    assert fit is not None and fit.plan.inputs.family == TOY
    with pytest.raises(ValueError, match="the toy plan counts CUDA only"):
        _toy_inputs(device="cpu")


def test_the_shipped_families_are_looked_up_by_name():
    from lightning_eagle.draft.dspark_export import DSPARK
    from lightning_eagle.draft.export import EAGLE3

    assert planning_family(EAGLE3).phases[1:3] == ("teacher", "draft unroll")
    assert planning_family(DSPARK).census is not None  # its drafter step is a census of the real step on meta
    with pytest.raises(ValueError, match="draft family 'nope' is not registered"):
        planning_family("nope")
