"""Average the replicated draft's gradients over all ranks (the job DDP would do; ModelParallelStrategy does none).

Under expert parallelism every rank trains the same draft on different tokens, so before each optimizer step the
gradients are averaged over the whole world — the same result as one process whose loss is the mean of the ranks'
losses. Parameters that are already sharded DTensors (a draft wrapped with FSDP2 ``fully_shard``) are skipped:
FSDP reduce-scatters their gradients itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor


@torch.no_grad()
def all_reduce_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None) -> int:
    """Average ``.grad`` of the trainable, non-DTensor ``parameters`` over ``group``; returns how many were averaged.

    Every rank must pass the same parameters in the same order. A parameter with a gradient on some ranks but not on
    others (e.g. a branch only one rank's batch reached) gets a zero gradient where it is missing, so that every
    rank reduces identical buckets; a parameter without a gradient anywhere keeps ``grad=None`` (the optimizer then
    skips it, as it would in one process). Gradients travel as one flat bucket per dtype: one collective each,
    instead of one per tensor.
    """
    params = [p for p in parameters if p.requires_grad and not isinstance(p, DTensor)]
    world = dist.get_world_size(group)
    if world == 1 or not params:
        return 0
    device = params[0].device
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    buckets: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for p, anywhere in zip(params, has_grad.tolist()):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets[p.grad.dtype].append(p.grad)
    for grads in buckets.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)
    return sum(len(g) for g in buckets.values())
