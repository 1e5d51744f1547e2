"""``validate_layout`` / ``validate_target_config``: every refusal of ``eagle3_training.md`` §11 and issue #5 item 3
raises the named exception with a message that names the setting (pure functions: no processes). The layout's
settings are ``ParallelLayout``'s fields and every layout is validated when built, so a refused one cannot exist."""

from __future__ import annotations

import pytest

from lightning_eagle.k3 import config_from_name
from lightning_eagle.parallel import ParallelLayout, UnsupportedLayoutError, validate_layout, validate_target_config

VALID = dict(world_size=4, num_experts=8, expert_parallel_size=2)

REFUSALS = [
    # (overrides, exception, fragments the message must contain)
    ({"target_backend": "sglang"}, NotImplementedError, ["requires target_model_backend='colocated'", "sglang"]),
    ({"target_backend": "vllm"}, NotImplementedError, ["requires target_model_backend='colocated'"]),
    ({"target_force_hf": True}, ValueError, ["target_force_hf"]),
    ({"tensor_parallel_size": 2}, NotImplementedError, ["tensor_parallel_size=2", "neither context nor tensor"]),
    ({"context_parallel_size": 4}, NotImplementedError, ["context_parallel_size=4", "neither context nor tensor"]),
    ({"pipeline_parallel_size": 2}, NotImplementedError, ["pipeline_parallel_size=2", "Pipeline parallelism"]),
    ({"sequence_packing": True}, NotImplementedError, ["sequence_packing=True", "Sequence packing"]),
    ({"p_eagle": True}, NotImplementedError, ["p_eagle=True", "Parallel drafting"]),
    ({"num_experts": 8, "expert_parallel_size": 3, "world_size": 3}, ValueError, ["num_experts (8)", "(3)"]),
    ({"world_size": 3, "expert_parallel_size": 2}, ValueError, ["expert_parallel_size (2)", "world size (3)"]),
    ({"expert_parallel_size": 0}, ValueError, ["expert_parallel_size must be a positive int"]),
    ({"device_types": ["cuda", "cpu", "cuda", "cuda"]}, ValueError, ["mixed device types", "'cpu'", "'cuda'"]),
    ({"target_dispatcher": "deepep", "device_types": ["cpu"] * 4}, ValueError, ["needs CUDA", "'torch'"]),
    ({"target_dispatcher": "alltoall"}, ValueError, ["target_dispatcher='alltoall' is unknown"]),
]


@pytest.mark.parametrize(("overrides", "exc", "fragments"), REFUSALS, ids=lambda v: str(v)[:40])
def test_refusals_name_the_setting(overrides, exc, fragments):
    with pytest.raises(exc) as err:
        ParallelLayout(**{**VALID, **overrides})
    for fragment in fragments:
        assert fragment in str(err.value)


def test_unsupported_layouts_are_both_value_and_not_implemented_errors():
    with pytest.raises(UnsupportedLayoutError) as err:
        ParallelLayout(**VALID, tensor_parallel_size=2)
    assert isinstance(err.value, ValueError) and isinstance(err.value, NotImplementedError)


@pytest.mark.parametrize(
    "layout",
    [
        dict(world_size=1, num_experts=8),
        dict(world_size=4, num_experts=8, expert_parallel_size=4),
        dict(world_size=64, num_experts=896, expert_parallel_size=64),  # the reference K3 recipe
        dict(world_size=56, num_experts=896, expert_parallel_size=7, device_types=["cuda"] * 56),
        dict(world_size=8, num_experts=896, expert_parallel_size=8, target_dispatcher="deepep", device_types=["cuda"]),
    ],
)
def test_supported_layouts_pass(layout):
    assert validate_layout(ParallelLayout(**layout)) is None


def test_the_validator_judges_a_layout_built_without_it():
    """``validate_layout`` is the layout's own check, not only its constructor's: a copy that skipped
    ``__post_init__`` is refused by name as well."""
    layout = ParallelLayout(**VALID)
    object.__setattr__(layout, "p_eagle", True)
    with pytest.raises(UnsupportedLayoutError, match="p_eagle=True"):
        validate_layout(layout)


def test_target_config_must_be_kimi_linear():
    validate_target_config(config_from_name("k3-tiny"), [1, 3, 5])
    with pytest.raises(ValueError, match="model_type 'kimi_linear'.*'llama'"):
        validate_target_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="no target config was given"):
        validate_target_config(None)
    outer = {"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear", "num_hidden_layers": 6}}
    validate_target_config(outer, [0, 3, 6])  # dispatch on the text config, never the outer "kimi_k3"


def test_aux_ids_are_checked_against_the_layer_count():
    with pytest.raises(ValueError, match=r"\[1, 3, 7\].*6-layer"):
        validate_target_config(config_from_name("k3-tiny"), [1, 3, 7])
