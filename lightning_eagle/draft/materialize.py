"""Build a draft on the meta device and materialise it directly on its device in its training dtype.

A real K3 draft built the plain way is ~10.5 GB of fp32 on the host per rank (the 163840 × 7168 embedding alone is
4.7 GB) before it is cast and moved. Here nothing full-size ever exists on the host: the module tree is built on
meta, cast there, allocated once on the device (``to_empty``), and each module's own parameters are initialised on
the CPU in fp32, one module at a time (the largest is ``lm_head`` or ``fc``), then copied over.

Initial values are a function of ``(seed, parameter name)`` only — the same on every rank, device, dtype and world
size. Each module is initialised by the root module's ``init_module(module)`` when it has one (the drafts of both
families: :func:`normal_init`, their reference trainers' rule), else by its own ``reset_parameters()`` (PyTorch's
defaults: ``nn.Linear``'s Kaiming-uniform, ``nn.Embedding``'s N(0, 1), ones for norms). Parameters listed in
``skip`` (the embedding, copied from the target right after) are left uninitialised.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return factory()


def check_initializer_range(std: object) -> None:
    """A draft config's ``initializer_range`` (the std :func:`normal_init` draws with): a positive finite number."""
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not (math.isfinite(std) and std > 0):
        raise ValueError(f"initializer_range must be a positive finite number, got {std!r}")


@torch.no_grad()
def normal_init(module: nn.Module, std: float) -> None:
    """Initialise ``module``'s own parameters as Hugging Face's ``PreTrainedModel._init_weights`` does (run by
    ``post_init()`` in both reference trainers: DeepSpec's DSpark and SpecForge's EAGLE-3 drafts): ``nn.Linear`` and
    ``nn.Embedding`` weights N(0, ``std``), biases 0 (an embedding's padding row 0); any other module (the norms:
    gains 1) by its own ``reset_parameters()``."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    else:
        module.reset_parameters()


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

    Integer/bool buffers keep their dtypes (they are zero-filled; e.g. the vocab map is installed afterwards). Each
    submodule is initialised by ``module.init_module(submodule)`` if ``module`` has it, else by its own
    ``reset_parameters()`` (module docstring)."""
    skip = set(skip)
    init = getattr(module, "init_module", None) or _reset_parameters
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
        _init_own_parameters(sub, own, _module_seed(seed, prefix), init)
    return module


def _reset_parameters(module: nn.Module) -> None:
    module.reset_parameters()


def _init_own_parameters(
    sub: nn.Module, own: list[tuple[str, nn.Parameter]], seed: int, init: Callable[[nn.Module], None]
) -> None:
    """Run ``init(sub)`` on fp32 CPU stand-ins of its own parameters, then copy them into place."""
    real = dict(own)
    stand_ins = {n: nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=False) for n, p in own}
    for n, p in stand_ins.items():
        setattr(sub, n, p)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            init(sub)
        for n, p in real.items():
            p.copy_(stand_ins[n])
    finally:
        for n, p in real.items():
            setattr(sub, n, p)
