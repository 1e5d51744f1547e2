"""``launch_local``: results in rank order; a failing or crashing rank is reported with its cause, quickly."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_eagle.parallel.local_launch import launch_local

pytestmark = pytest.mark.multiprocess


def _sum_of_ranks(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": t, "threads": torch.get_num_threads()}


def test_results_come_back_in_rank_order():
    out = launch_local(_sum_of_ranks, 3)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["sum"].item() == 6.0 and o["threads"] == 1 for o in out)


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 blocks here until it is terminated


def _rank1_crashes(rank, world):
    if rank == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.parametrize(
    ("fn", "fragment"),
    [(_rank1_raises, "ValueError: rank one is broken"), (_rank1_crashes, "exited with code 3 without reporting")],
)
def test_a_failing_rank_is_reported_with_its_cause(fn, fragment):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2") as err:
        launch_local(fn, 2, timeout_s=60)
    assert fragment in str(err.value)
    assert time.monotonic() - start < 30  # not the 60 s collective timeout
