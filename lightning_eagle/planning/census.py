"""Counting what a step allocates by running the real code on the meta device: :class:`LiveBytes` records every
storage an op creates and watches it through a weak reference, so the live bytes after each op are exactly what the
caching allocator would have to hold (no fragmentation, no rounding), and their maximum is the step's peak.

Meta tensors carry no values and no device kernels, so two device facts are supplied here:
:func:`meta_autocast_as_cpu` (torch has no autocast state for ``meta``: answered as for CPU, where it is off) and
:func:`cuda_attention_on_meta` (on meta ``F.scaled_dot_product_attention`` would run the math kernel and its full
score matrix; with a mask, on CUDA, the dispatcher picks the memory-efficient kernel: flash takes no mask. This
context runs that kernel's meta twin with the additive bias the dispatcher makes of a boolean mask, in the query dtype,
its last dimension padded to a multiple of 16, so the census counts what the GPU holds).

The DSpark memory plan is such a census (:mod:`lightning_eagle.planning.dspark_census`); the EAGLE-3 plan's terms are
analytic and this census is what its tests check them against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_MEM_EFFICIENT_BIAS_ALIGNMENT = 16  # the kernel's bias row alignment (elements); the dispatcher pads to it


@dataclass(frozen=True)
class StepCensus:
    """Bytes a step allocates beyond its inputs and parameters: alive after the forward (what autograd keeps for the
    backward, the loss included) and at the peak of forward + backward; ``.grad`` buffers not included. ``held``:
    the bytes of what it reads (inputs, parameters, gradient buffers), what a device's allocator holds besides."""

    kept_after_forward: int
    peak: int
    held: int = 0


class LiveBytes(TorchDispatchMode):
    """Every storage an op creates, watched through a weak reference: live bytes after each op, and their peak.
    ``ignore``: storages that exist before the step (parameters, inputs)."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.ignore, self.refs, self.peak = ignore, {}, 0

    def live(self) -> int:
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.refs and storage._cdata not in self.ignore:
                    self.refs[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.live())
        return out


def storages(tensors) -> set[int]:
    """The storage ids of ``tensors`` (what :class:`LiveBytes` is told to ignore)."""
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    unique = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor)}
    return sum(unique.values())


@contextlib.contextmanager
def meta_autocast_as_cpu() -> Iterator[None]:
    """Code that records and re-enters the autocast state of its input's device (the fused losses) asks it for
    ``meta``, which torch has no notion of: answer as for CPU (autocast off there), which runs the same ops."""
    is_enabled, get_dtype, autocast = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.autocast

    def cpu(device_type):
        return "cpu" if device_type == "meta" else device_type

    torch.is_autocast_enabled = lambda *device: is_enabled(*map(cpu, device))
    torch.get_autocast_dtype = lambda device: get_dtype(cpu(device))
    torch.autocast = lambda device_type, *a, **k: autocast(cpu(device_type), *a, **k)
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype, torch.autocast = is_enabled, get_dtype, autocast


def _efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    if kwargs.get("enable_gqa") or is_causal or dropout_p or attn_mask is None or not query.is_meta:
        raise NotImplementedError("cuda_attention_on_meta models a masked, non-causal, dropout-free call on meta only")
    bias = attn_mask
    if bias.dtype == torch.bool:
        bias = torch.where(bias, 0.0, float("-inf")).to(query.dtype)
    length = bias.shape[-1]
    pad = -length % _MEM_EFFICIENT_BIAS_ALIGNMENT
    if pad:
        padded = bias.new_empty(*bias.shape[:-1], length + pad)
        padded[..., :length].copy_(bias)
        bias = padded[..., :length]
    bias = bias.expand(*query.shape[:-1], length)
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True, scale=scale)[0]


@contextlib.contextmanager
def cuda_attention_on_meta() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` with a mask, as CUDA runs it (module docstring), for meta tensors."""
    plain = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _efficient_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain
