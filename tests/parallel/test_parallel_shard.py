"""Expert slices, dispatcher installation and the per-rank memory report (single process)."""

from __future__ import annotations

import pytest
import torch

from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name
from lightning_eagle.k3.moe import local_dispatch
from lightning_eagle.parallel.memory import memory_table, per_rank_memory_report
from lightning_eagle.parallel.shard import enable_expert_parallel, expert_range, moe_layers, routed_expert_bytes


@pytest.mark.parametrize(
    ("num_experts", "ep", "rank", "expected"),
    [(8, 1, 0, (0, 8)), (8, 2, 1, (4, 4)), (8, 4, 2, (4, 2)), (896, 64, 63, (882, 14)), (896, 7, 3, (384, 128))],
)
def test_expert_range_is_contiguous_and_equal(num_experts, ep, rank, expected):
    assert expert_range(num_experts, ep, rank) == expected


def test_expert_range_refusals():
    with pytest.raises(ValueError, match=r"num_experts \(896\) is not divisible by expert_parallel_size \(48\)"):
        expert_range(896, 48, 0)
    with pytest.raises(ValueError, match="ep_rank 2 is outside the expert-parallel group of size 2"):
        expert_range(8, 2, 2)


def _tiny(expert_slice=None):
    config = config_from_name("k3-tiny-fast", num_hidden_layers=3)
    return KimiK3ForCausalLM(config, expert_range=expert_slice).init_weights(0).freeze()


def test_enable_expert_parallel_installs_on_every_moe_layer():
    model = _tiny((4, 4))

    def dispatcher(experts, z, idx, weight):  # stands in for a distributed dispatcher
        raise AssertionError

    names = enable_expert_parallel(model, dispatcher, ep_size=2, ep_rank=1)
    assert names == ["model.layers.1.block_sparse_moe", "model.layers.2.block_sparse_moe"]
    assert all(moe.dispatch is dispatcher for _, moe in moe_layers(model))


def test_a_wrong_slice_is_refused_and_nothing_is_installed():
    model = _tiny((4, 4))
    with pytest.raises(RuntimeError, match=r"layers\.1\.block_sparse_moe\.experts holds experts \[4, 8\).*\(0, 4\)"):
        enable_expert_parallel(model, object(), ep_size=2, ep_rank=0)
    assert all(moe.dispatch is local_dispatch for _, moe in moe_layers(model))


def test_a_complete_model_keeps_its_local_dispatch_at_ep1():
    model = _tiny()
    enable_expert_parallel(model, None, ep_size=1, ep_rank=0)
    assert all(moe.dispatch is local_dispatch for _, moe in moe_layers(model))


def test_a_partial_model_without_dispatcher_fails_loudly():
    model = _tiny((0, 4))
    with pytest.raises(RuntimeError, match="holds experts \\[0, 4\\) of 8.*ExpertParallelStrategy"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_routed_expert_bytes_halve_with_the_slice():
    assert routed_expert_bytes(_tiny((4, 4))) * 2 == routed_expert_bytes(_tiny()) > 0


# ---- per-rank memory ---------------------------------------------------------------------------------------------

GB = 1e9


@pytest.mark.parametrize(("ep", "packed_gb", "bf16_gb"), [(8, 181, 681), (32, 45.2, 170), (64, 22.6, 85)])
def test_real_k3_memory_reproduces_the_spec_budget(ep, packed_gb, bf16_gb):
    report = per_rank_memory_report(config_from_name("k3"), ep, torch.bfloat16)
    assert report.experts_per_rank == 896 // ep
    assert report.non_routed_params == pytest.approx(56.7e9, rel=0.01)  # k3_target.md §1.3
    assert report.non_routed_bytes / GB == pytest.approx(113, rel=0.01)
    assert report.routed_packed_bytes / GB == pytest.approx(packed_gb, rel=0.01)
    assert report.routed_dequantised_bytes / GB == pytest.approx(bf16_gb, rel=0.01)
    assert report.routed_params_per_rank * ep == pytest.approx(2.72e12, rel=0.01)


def test_memory_report_matches_a_materialised_model():
    config = config_from_name("k3-tiny")
    model = KimiK3ForCausalLM(config, expert_range=(2, 2)).init_weights(0).cast_to(torch.bfloat16)
    report = per_rank_memory_report(config, ep_size=4, dtype=torch.bfloat16)
    non_routed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    assert report.non_routed_bytes == non_routed
    assert report.routed_dequantised_bytes == routed_expert_bytes(model)
    assert report.routed_packed_bytes == report.routed_params_per_rank * 17 // 32  # 4 bits + 1 scale byte / 32


def test_memory_table_and_refusal():
    table = memory_table(config_from_name("k3"), [8, 64])
    assert table.count("\n") == 3 and "| 64 | 14 | 113.5 GB | 22.6 GB | 85.1 GB |" in table
    with pytest.raises(ValueError, match=r"num_experts \(896\) is not divisible by expert_parallel_size \(48\)"):
        per_rank_memory_report(config_from_name("k3"), 48)
