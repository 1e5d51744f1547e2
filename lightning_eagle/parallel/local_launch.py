"""Run a function in N local processes joined into one process group (CPU tests and benchmarks, no Lightning).

``launch_local(fn, nprocs, *args)`` calls ``fn(rank, world_size, *args)`` in every process with the default group
initialised (gloo, a free ``MASTER_PORT``) and returns the ranks' return values in rank order. A failing rank's
traceback is re-raised in the caller and the other ranks (blocked in a collective) are terminated, so a broken test
fails fast instead of hanging until the collective timeout.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port the OS just reported free (bind to port 0); the tiny race before the workers bind it is accepted."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable,
    args: tuple,
    results: Any,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    # One intra-op thread per rank: N ranks × default threads oversubscribe small CPUs (10x slower when contended),
    # and a forked child must not reuse the parent's OpenMP pool.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Bytes, not tensors: torch's queue shares tensors through file descriptors that die with this process.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


def launch_local(
    fn: Callable,
    nprocs: int,
    *args: Any,
    start_method: str = "fork",
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` processes; return their results in rank order.

    ``start_method="fork"`` starts in well under a second (no re-import); ``"spawn"`` needs ``fn`` importable at
    module level and pays the imports (≈ 7 s per rank). Results travel as ``torch.save`` bytes (picklable values).
    """
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, nprocs, port, backend, timeout_s, fn, args, results), daemon=True)
        for rank in range(nprocs)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) + len(failures) < nprocs and time.monotonic() < deadline:
            try:
                rank, ok, out = results.get(timeout=0.5)
            except queue.Empty:
                # A rank that exits non-zero without a message crashed (signal, os._exit): no need to wait it out.
                for r, p in enumerate(procs):
                    if r not in outputs and r not in failures and p.exitcode not in (None, 0):
                        failures[r] = f"exited with code {p.exitcode} without reporting"
            else:
                if ok:
                    outputs[rank] = torch.load(io.BytesIO(out), weights_only=False)
                else:
                    failures[rank] = out
            if failures:
                # The others usually follow within seconds ("connection closed by peer"); give them a moment so
                # that the report shows the root cause, not only its echo.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=0.5 if failures else 5)
        for p in procs:  # only the processes started here, by handle
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    silent = sorted(set(range(nprocs)) - set(outputs) - set(failures))
    if failures or silent:
        report = [f"rank {r} of {nprocs} failed:\n{tb}" for r, tb in sorted(failures.items())]
        report += [f"rank {r} of {nprocs} reported nothing within {timeout_s:.0f} s" for r in silent]
        raise (RuntimeError if failures else TimeoutError)("\n".join(report))
    return [outputs[r] for r in range(nprocs)]
