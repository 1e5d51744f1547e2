"""``ParallelLayout`` (every instance is valid; facts arrive by ``refine``) and the module↔strategy contract
(``TargetParallelism``): the strategy implements it, every other strategy gets a replicated target."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn

from lightning_eagle.parallel import (
    ParallelLayout,
    ReplicatedTarget,
    TargetParallelism,
    UnsupportedLayoutError,
    target_parallelism,
)
from lightning_eagle.parallel.strategy import ExpertParallelStrategy

REFUSED = [
    ({"tensor_parallel_size": 2}, UnsupportedLayoutError, "tensor_parallel_size=2"),
    ({"context_parallel_size": 2}, UnsupportedLayoutError, "context_parallel_size=2"),
    ({"pipeline_parallel_size": 2}, UnsupportedLayoutError, "pipeline_parallel_size=2"),
    ({"sequence_packing": True}, UnsupportedLayoutError, "sequence_packing=True"),
    ({"target_backend": "vllm"}, UnsupportedLayoutError, "target_backend='vllm'"),
    ({"p_eagle": True}, UnsupportedLayoutError, "p_eagle=True"),
    ({"target_force_hf": True}, ValueError, "target_force_hf=True"),
    ({"expert_parallel_size": 3, "world_size": 4}, ValueError, r"must divide the world size \(4\)"),
    ({"expert_parallel_size": 3, "num_experts": 8}, ValueError, r"num_experts \(8\) is not divisible"),
    ({"device_types": ("cpu", "cuda")}, ValueError, "mixed device types"),
]


@pytest.mark.parametrize(("fields", "exc", "fragment"), REFUSED)
def test_an_unsupported_layout_cannot_be_built(fields, exc, fragment):
    with pytest.raises(exc, match=fragment):
        ParallelLayout(**fields)


@pytest.mark.parametrize(("fields", "exc", "fragment"), REFUSED[-3:])
def test_refine_validates_the_new_facts(fields, exc, fragment):
    settings = {k: v for k, v in fields.items() if k == "expert_parallel_size"}
    facts = {k: v for k, v in fields.items() if k != "expert_parallel_size"}
    layout = ParallelLayout(**settings)  # valid while the facts are unknown (None), no placeholder values
    with pytest.raises(exc, match=fragment):
        layout.refine(**facts)


def test_refine_takes_facts_not_settings():
    with pytest.raises(TypeError, match=r"not settings: \['tensor_parallel_size'\]"):
        ParallelLayout().refine(tensor_parallel_size=2)


def test_data_parallel_size_and_frozen_fields():
    layout = ParallelLayout(expert_parallel_size=4).refine(world_size=16, num_experts=896, device_types=["cpu"] * 16)
    assert (layout.data_parallel_size, layout.device_types) == (4, ("cpu",) * 16)
    assert ParallelLayout().data_parallel_size is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.world_size = 8


def test_the_strategy_owns_and_refines_its_layout():
    strategy = ExpertParallelStrategy(expert_parallel_size=2, start_method="fork")
    assert strategy.layout == ParallelLayout(expert_parallel_size=2)
    L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    assert strategy.layout.world_size == 4 and strategy.layout.data_parallel_size == 2
    strategy.validate_target({"model_type": "kimi_linear", "num_experts": 8})
    assert strategy.layout.num_experts == 8


def test_contract_is_declared_not_duck_typed():
    assert isinstance(ExpertParallelStrategy(expert_parallel_size=2), TargetParallelism)
    assert isinstance(ReplicatedTarget(), TargetParallelism)
    for other in (None, SingleDeviceStrategy(torch.device("cpu")), DDPStrategy()):
        placement = target_parallelism(other)
        assert isinstance(placement, ReplicatedTarget)
        assert placement.expert_range(8) is None and placement.layout.expert_parallel_size == 1
        target = nn.Linear(2, 2)
        assert placement.parallelize_target(target) is target
