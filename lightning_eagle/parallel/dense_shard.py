"""Shard the frozen K3 target's dense (non-routed) weights over every rank with FSDP2, gathered layer by layer.

At real scale the non-routed weights (embedding, ``lm_head``, attention/KDA projections, norms, dense MLP, router,
latent projections, shared experts) are ≈ 113 GB in bf16: replicated, they do not fit an 80 GB GPU. Here each of
them is split along dim 0 over the whole world (``fully_shard`` with a 1-D mesh of all ranks), and each FSDP unit is
gathered just before its forward and freed right after it (``reshard_after_forward=True``): a rank holds ``1/world``
of the dense weights plus one unit's full weights at a time. The target has no gradients, so no reduce-scatter ever
runs.

Units: every decoder layer, the embedding and ``lm_head`` (each called as a module, so FSDP's hooks gather them).
Routed experts are *ignored* by FSDP: they are already expert-parallel (different on every EP rank). The few
root-level weights (final norm, the AttnRes output mixer; a few ``H``-vectors) stay replicated: they are read by
``capture``/incremental decoding outside any module call that FSDP could hook.

``lm_head.weight`` is also read directly by the chunked teacher; :func:`gathered_weight` gathers it for that use.
The loader (``KimiK3ForCausalLM.from_pretrained(..., dense_mesh=mesh)``) shards the meta-device model *before*
materialising it and reads only each rank's rows of every dense tensor from the safetensors files.

The trained draft (``model.draft.shard``, either family) is sharded the same way over the units it names
(:func:`shard_draft`), with gradients; :func:`with_full_parameters` serves weights read outside any unit call (the
DSpark objective's heads), :func:`full_state_dict` the whole tensors of an export.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from lightning_eagle.k3.experts import RoutedExperts

T = TypeVar("T")


def dense_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of a ``KimiK3ForCausalLM``: each decoder layer, the embedding, ``lm_head``."""
    return [*model.model.layers, model.model.embed_tokens, model.lm_head]


def shard_dense_weights(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Apply ``fully_shard`` to every dense unit of ``model`` (typically still on the meta device), routed experts
    ignored. Refuses tied embeddings: one tensor cannot belong to two units."""
    if getattr(model.config, "tie_word_embeddings", False):
        raise NotImplementedError(
            "target_shard_dense with tie_word_embeddings=True is not supported (K3 unties them); "
            "set target_shard_dense=false"
        )
    for unit in dense_units(model):
        experts = [p for m in unit.modules() if isinstance(m, RoutedExperts) for p in m.parameters(recurse=False)]
        fully_shard(unit, mesh=mesh, reshard_after_forward=True, ignored_params=set(experts) or None)
    return model


def shard_draft(draft: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2 over all ranks for a draft's trained parameters (``model.draft.shard``): every unit the draft names
    (``draft.fsdp_units()``: EAGLE-3's ``fc``, layer, norm, ``lm_head``; DSpark's context projection, layers, final
    norm and heads) is gathered for its forward and its backward; gradients are reduce-scattered (averaged over the
    world) and AdamW states live only for each rank's shard. A unit's other weight-reading methods (its class's
    ``fsdp_forward_methods``) gather like its forward, and :func:`with_full_parameters` runs any computation over
    whole weights of units.

    ``compute_dtype`` (fp32 master weights of a 16-bit draft, ``model.draft.master_weights``): each unit's parameters
    become fp32 shards (and so its AdamW states; the upcast is one unit at a time, before its shard is taken), each
    unit is gathered in ``compute_dtype`` and runs in it, and gradients are reduce-scattered in fp32 — FSDP2's
    mixed-precision policy."""
    policy = MixedPrecisionPolicy() if compute_dtype is None else MixedPrecisionPolicy(compute_dtype, torch.float32)
    for unit in draft.fsdp_units():
        if compute_dtype is not None:
            unit.to(torch.float32)
        fully_shard(unit, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
        setattr(unit, _FULL_CALL, _call)  # a plain instance function: FSDP wraps it with its forward hooks below
        for name in (*getattr(type(unit), "fsdp_forward_methods", ()), _FULL_CALL):
            register_fsdp_forward_method(unit, name)
    return draft


_FULL_CALL = "call_with_full_parameters"


def _call(fn: Callable[..., T], *inputs: Any) -> T:
    return fn(*inputs)


def with_full_parameters(units: Sequence[nn.Module], fn: Callable[..., T], *inputs: torch.Tensor) -> T:
    """``fn(*inputs)`` with the whole parameters of every unit in ``units``, as if ``fn`` were their forward: an
    FSDP2 unit (made by :func:`shard_draft`) is gathered before ``fn``, freed after it, gathered again for its backward
    and its gradients reduce-scattered after that. For a computation that reads units' weights directly, outside any
    of their calls (a fused loss handed ``head.weight``). ``inputs``: ``fn``'s differentiable inputs (their gradients
    tell FSDP the units' backward is done); ``fn`` returns tensors, or a tuple / list / dict of them (what FSDP hooks
    the backward gather on). Units that are not sharded are used as they are."""
    sharded = [unit for unit in units if isinstance(unit, FSDPModule)]
    missing = [type(unit).__name__ for unit in sharded if not hasattr(unit, _FULL_CALL)]
    if missing:
        raise ValueError(f"with_full_parameters: {missing} were FSDP-sharded without shard_draft (no {_FULL_CALL})")

    def nested(remaining: list[nn.Module], *args: Any) -> T:
        if not remaining:
            return fn(*args)
        return getattr(remaining[0], _FULL_CALL)(functools.partial(nested, remaining[1:]), *args)

    return nested(sharded, *inputs)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every FSDP2 shard gathered into whole CPU tensors, on rank 0 (other ranks get
    ``{}``). A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


@contextmanager
def gathered_weight(module: nn.Module) -> Iterator[torch.Tensor]:
    """``module.weight`` in full for the duration of the block (an all-gather if the module is an FSDP unit)."""
    if not isinstance(module, FSDPModule):
        yield module.weight
        return
    module.unshard()
    try:
        yield module.weight
    finally:
        module.reshard()


def has_sharded_trainable_parameters(module: nn.Module | None) -> bool:
    """Whether the *trained* parameters (the draft's) are FSDP-sharded; a sharded frozen target does not count (its
    weights are never checkpointed)."""
    return module is not None and any(is_sharded(p) for p in module.parameters() if p.requires_grad)


def dense_bytes_held(model: nn.Module) -> int:
    """Bytes of the dense (non-routed) parameters this rank holds now (its shards, or full replicated tensors)."""
    experts = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters(recurse=False)}
    total = 0
    for p in model.parameters():
        if id(p) not in experts:
            local = p.to_local() if is_sharded(p) else p
            total += local.numel() * local.element_size()
    return total
