"""Build a draft on the meta device and materialise it directly on its device in its training dtype.

A real K3 draft built the plain way is ~10.5 GB of fp32 on the host per rank (the 163840 × 7168 embedding alone is
4.7 GB) before it is cast and moved. Here nothing full-size ever exists on the host: the module tree is built on
meta, cast there, allocated once on the device (``to_empty``), and each module's own parameters are initialised on
the CPU in fp32, one module at a time (the largest is ``lm_head`` or ``fc``), then copied over.

Initial values are a function of ``(seed, parameter name)`` only — the same on every rank, device, dtype and world
size — with each module's own default initialiser (``reset_parameters``: ``nn.Linear``'s Kaiming-uniform, ones for
norms). Parameters listed in ``skip`` (the embedding, copied from the target right after) are left uninitialised.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return factory()


def _module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def materialize(
    module: nn.Module,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int,
    skip: Iterable[str] = (),
) -> nn.Module:
    """Allocate ``module`` (built on meta) on ``device`` with floating tensors in ``dtype`` and initialise it.

    Integer/bool buffers keep their dtypes (they are zero-filled; e.g. the vocab map is installed afterwards)."""
    skip = set(skip)
    module.to(dtype=dtype)  # on meta: free; floating tensors only
    module.to_empty(device=device)
    for buffer in module.buffers():
        buffer.zero_()
    for prefix, sub in module.named_modules():
        own = [(n, p) for n, p in sub.named_parameters(recurse=False) if f"{prefix}.{n}".lstrip(".") not in skip]
        if not own:
            continue
        if not hasattr(sub, "reset_parameters"):
            raise TypeError(
                f"cannot initialise {prefix or 'the root'} ({type(sub).__name__}) on its device: it holds parameters "
                "but has no reset_parameters(); give it one"
            )
        _init_own_parameters(sub, own, _module_seed(seed, prefix))
    return module


def _init_own_parameters(sub: nn.Module, own: list[tuple[str, nn.Parameter]], seed: int) -> None:
    """Run ``sub.reset_parameters()`` on fp32 CPU stand-ins of its own parameters, then copy them into place."""
    real = dict(own)
    stand_ins = {n: nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=False) for n, p in own}
    for n, p in stand_ins.items():
        setattr(sub, n, p)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            sub.reset_parameters()
        for n, p in real.items():
            p.copy_(stand_ins[n])
    finally:
        for n, p in real.items():
            setattr(sub, n, p)
