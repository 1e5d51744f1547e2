"""Draft gradient averaging over the world (2 forked gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard  # imported here once, not in every forked rank
from torch.distributed.tensor import DTensor

from lightning_eagle.parallel.grad_sync import all_reduce_gradients
from lightning_eagle.parallel.local_launch import launch_local

pytestmark = pytest.mark.multiprocess


def _average(rank, world):
    torch.manual_seed(0)  # identical replicas
    used = nn.Linear(4, 3)
    only_rank1 = nn.Linear(4, 3)  # a branch only rank 1's batch reaches
    never = nn.Linear(4, 3)
    frozen = nn.Linear(4, 3).requires_grad_(False)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + rank))  # different data per rank
    loss = (used(x) * (rank + 1)).square().sum() + frozen(x).sum()
    if rank == 1:
        loss = loss + only_rank1(x).sum()
    loss.backward()
    local = {n: p.grad.clone() for n, p in [("w", used.weight), ("b", used.bias)]}
    local["w1"] = only_rank1.weight.grad.clone() if rank == 1 else torch.zeros(3, 4)
    params = [*used.parameters(), *only_rank1.parameters(), *never.parameters(), *frozen.parameters()]
    reduced = all_reduce_gradients(params)
    return {
        "local": local,
        "reduced": reduced,
        "w": used.weight.grad,
        "b": used.bias.grad,
        "w1": only_rank1.weight.grad,
        "never": [p.grad for p in never.parameters()],
        "frozen": [p.grad for p in frozen.parameters()],
    }


def test_gradients_are_averaged_over_ranks():
    r0, r1 = launch_local(_average, 2)
    for name in ("w", "b", "w1"):
        mean = (r0["local"][name] + r1["local"][name]) / 2
        assert not torch.equal(r0["local"][name], r1["local"][name])  # the ranks really had different gradients
        torch.testing.assert_close(r0[name], mean)
        torch.testing.assert_close(r1[name], mean)
    # used.{weight,bias} + only_rank1.{weight,bias}; `never` keeps None everywhere, frozen parameters are skipped
    assert r0["reduced"] == r1["reduced"] == 4
    assert r0["never"] == r1["never"] == [None, None]
    assert r0["frozen"] == r1["frozen"] == [None, None]


def _fsdp_grads_untouched(rank, world):
    torch.manual_seed(0)
    sharded = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (world,)))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    (sharded(x) * torch.randn(3, 4)).sum().backward()
    before = [p.grad.to_local().clone() for p in sharded.parameters()]
    reduced = all_reduce_gradients(sharded.parameters())
    after = [p.grad.to_local() for p in sharded.parameters()]
    return {
        "dtensor": all(isinstance(p, DTensor) for p in sharded.parameters()),
        "reduced": reduced,
        "same": all(torch.equal(a, b) for a, b in zip(before, after)),
    }


def test_fsdp_sharded_gradients_are_left_to_fsdp():
    for out in launch_local(_fsdp_grads_untouched, 2):
        assert out == {"dtensor": True, "reduced": 0, "same": True}
