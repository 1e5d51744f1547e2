"""Expert-parallel dispatchers: all-to-all == all-gather twin == one process holding every expert.

Ranks hold different token counts (one holds none), experts are random, routing is random top-k; the multi-process
cases run in forked gloo ranks.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from lightning_eagle.k3.experts import RoutedExperts
from lightning_eagle.parallel.dispatcher import (
    AllGatherExpertDispatcher,
    DeepEPDispatcher,
    HybridEPDispatcher,
    TorchExpertDispatcher,
    build_dispatcher,
    check_dispatcher,
)
from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.parallel.shard import expert_range

E, D, INTER, K = 8, 32, 16, 3


def _experts(rng_seed: int = 0, expert_slice=None, dtype=torch.float32) -> RoutedExperts:
    gen = torch.Generator().manual_seed(rng_seed)
    full = RoutedExperts(E, D, INTER)
    gate_up = torch.randn(full.gate_up_proj.shape, generator=gen) / D**0.5
    down = torch.randn(full.down_proj.shape, generator=gen) / INTER**0.5
    start, count = expert_slice or (0, E)
    experts = RoutedExperts(E, D, INTER, (start, count))
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up[start : start + count])
        experts.down_proj.copy_(down[start : start + count])
    return experts.to(dtype).requires_grad_(False)


def _tokens(rank: int, count: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(count, D, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(count)]) if count else torch.empty(0, K)
    weight = torch.rand(count, K, generator=gen)
    return x, idx.long(), weight / weight.sum(-1, keepdim=True)


def _compare(rank, world, counts, dtype):
    local = _experts(expert_slice=expert_range(E, world, rank), dtype=dtype)
    full = _experts(dtype=dtype)
    x, idx, weight = _tokens(rank, counts[rank], dtype)
    with torch.no_grad():
        return {
            "all_to_all": TorchExpertDispatcher()(local, x, idx, weight),
            "all_gather": AllGatherExpertDispatcher()(local, x, idx, weight),
            "one_process": full(x, idx, weight),
        }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("counts", "dtype"),
    [([13, 5], torch.float32), ([0, 9], torch.float32), ([7, 0, 11, 3], torch.float32), ([6, 10], torch.bfloat16)],
)
def test_dispatchers_equal_one_process_with_uneven_token_counts(counts, dtype):
    results = launch_local(_compare, len(counts), counts, dtype)
    # An expert GEMM sees other row counts here than in one process (tokens of every rank): bf16 outputs may round
    # the other way on some CPUs (≤ 1 bf16 ulp, ~4e-3 at these magnitudes), hence bf16 tolerances for bf16 experts.
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1.6e-2}
    for rank, out in enumerate(results):
        ref = out["one_process"]
        assert ref.shape == (counts[rank], D)
        for name in ("all_to_all", "all_gather"):
            assert out[name].dtype == torch.float32 and out[name].shape == ref.shape, name  # fp32 combine
            torch.testing.assert_close(out[name], ref, **tol, msg=f"{name} rank {rank}")
        if counts[rank]:
            assert ref.abs().max() > 0.1  # not a vacuous comparison of zeros


def _misuse(rank, world):
    errors = {}
    wrong = _experts(expert_slice=expert_range(E, world, 1 - rank))  # the other rank's slice
    x, idx, weight = _tokens(rank, 4)
    try:
        TorchExpertDispatcher()(wrong, x, idx, weight)
    except RuntimeError as err:
        errors["wrong_slice"] = str(err)
    right = _experts(expert_slice=expert_range(E, world, rank))
    try:
        TorchExpertDispatcher()(right, x.requires_grad_(True), idx, weight)
    except RuntimeError as err:
        errors["grad"] = str(err)
    return errors


@pytest.mark.multiprocess
def test_dispatcher_refuses_a_wrong_slice_and_autograd():
    for rank, errors in enumerate(launch_local(_misuse, 2)):
        start = 4 * (1 - rank)
        assert f"holds experts [{start}, {start + 4}) of 8" in errors["wrong_slice"]
        assert f"expert_range=({4 * rank}, 4)" in errors["wrong_slice"]
        assert "torch.no_grad()" in errors["grad"]


# ---- deepep / hybridep: accepted names, never a silent fallback ------------------------------------------------------


@pytest.fixture
def no_deep_ep(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` now raises ImportError


@pytest.mark.parametrize("name", ["deepep", "hybridep"])
def test_gpu_dispatchers_name_the_package_when_missing(no_deep_ep, name):
    for construct in (lambda: check_dispatcher(name), lambda: build_dispatcher(name, None)):
        with pytest.raises(ImportError, match=f"target_dispatcher='{name}' needs the `deep_ep` package") as err:
            construct()
        assert "pip install" in str(err.value) and "target_dispatcher='torch'" in str(err.value)


def test_hybridep_needs_the_hybrid_ep_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))  # a DeepEP build without HybridEP
    with pytest.raises(ImportError, match="deep_ep.HybridEpBuffer"):
        HybridEPDispatcher()


def test_importable_gpu_library_is_still_not_replaced_by_torch(monkeypatch):
    fake = types.ModuleType("deep_ep")
    fake.HybridEpBuffer = object
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    for cls in (DeepEPDispatcher, HybridEPDispatcher):
        with pytest.raises(NotImplementedError, match="use target_dispatcher='torch'"):
            cls()


def test_unknown_dispatcher():
    with pytest.raises(ValueError, match="target_dispatcher='nccl' is unknown"):
        check_dispatcher("nccl")
