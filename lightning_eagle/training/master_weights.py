"""fp32 master weights for a replicated 16-bit draft (``model.draft.master_weights``).

The draft keeps its parameters in ``model.draft.dtype`` (bf16: what the forward and backward run in, what the
gradients are and what an export holds); the optimizer keeps an fp32 copy ``m`` of each and its own states in fp32.
A step is

    g32 = float(g);  m ← inner_step(m, g32);  p ← round_to_dtype(m)

so an update far below bf16's spacing (2⁻⁸ relative: a norm gain of 1.0 moves only by ≥ 2⁻⁸ ≈ 0.004) accumulates in
``m`` instead of being rounded away. This is DeepSpec's ``BF16Optimizer`` and the AMP "O2" recipe; a sharded draft
gets the same from FSDP2's mixed-precision policy (fp32 shards, bf16 gathers, fp32 gradient reduction), see
:func:`lightning_eagle.parallel.dense_shard.shard_draft`.

:class:`MasterWeights` is an optimizer over the *draft's* parameters, so what Lightning and the LR schedulers do to
``param_groups`` (gradient clipping, zeroing, the learning rate) acts on them as for any optimizer; each step copies
the groups' hyper-parameters into the inner optimizer, which owns the fp32 masters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist


class MasterWeights(torch.optim.Optimizer):
    """Wrap ``make_inner`` (a callable from a list of fp32 tensors to an optimizer over them) so that it steps fp32
    masters of the 16-bit ``params`` (module docstring). The masters start as copies of ``params`` and are copied from
    them again before the first step unless a state dict was loaded (weights changed between construction and the
    first step, by a checkpoint or a warm start, are never overwritten by stale masters).

    ``group`` (a process group of ranks whose ``params`` and gradients are identical: a replicated draft after its
    gradient sync): the masters and optimizer states are partitioned over its ranks, whole tensors, largest first to
    the least loaded rank (ZeRO stage 1), and each updated parameter is broadcast from its owner. A rank then holds
    about ``1/world`` of the fp32 state plus at most its largest tensor's. :meth:`state_dict` is then a collective
    that gives rank 0 the whole state (others get ``{}``), in the same layout as an unpartitioned one, so a resume
    may change the world size."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        make_inner: Callable[[list], torch.optim.Optimizer],
        group: dist.ProcessGroup | None = None,
    ):
        params = list(params)
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.owners = owners(params, self.group)
        here = dist.get_rank(self.group) if self.group is not None else 0
        self.owned = [i for i, owner in enumerate(self.owners) if owner == here]
        self.masters = [
            p.detach().to(torch.float32, copy=True) if owner == here else p.new_empty(0, dtype=torch.float32)
            for p, owner in zip(params, self.owners)
        ]  # a tensor this rank does not own has an empty master: the inner optimizer's groups keep every index
        for m in self.masters:
            m.requires_grad_(True)
        self.inner = make_inner(self.masters)
        model_param = {id(m): p for m, p in zip(self.masters, params)}
        groups = [{**g, "params": [model_param[id(m)] for m in g["params"]]} for g in self.inner.param_groups]
        super().__init__(groups, self.inner.defaults)
        self.params = params
        self._masters_current = False

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # Lightning's closure: forward, backward, then clipping of our params' gradients
        owned = [(self.params[i], self.masters[i]) for i in self.owned]
        if not self._masters_current:
            for p, m in owned:
                m.copy_(p)
            self._masters_current = True
        for group, inner_group in zip(self.param_groups, self.inner.param_groups):
            inner_group.update({k: v for k, v in group.items() if k != "params"})  # lr of the scheduler, …
        for p, m in owned:
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.inner.step()
        for p, m in owned:
            p.copy_(m)  # round to the draft's dtype
            m.grad = None
        if self.group is not None:
            for p, owner in zip(self.params, self.owners):
                dist.broadcast(p.data, src=dist.get_global_rank(self.group, owner), group=self.group)
        return loss

    def state_dict(self) -> dict[str, Any]:
        inner = self.inner.state_dict()
        mine = {i: (self.masters[i].detach().clone(), inner["state"].get(i)) for i in self.owned}
        if self.group is not None:
            parts: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(parts, mine, group=self.group)
            if dist.get_rank(self.group) != 0:
                return {}
            mine = {i: v for part in parts for i, v in part.items()}
        state = {"state": {i: s for i, (_, s) in sorted(mine.items()) if s is not None},
                 "param_groups": inner["param_groups"]}  # fmt: skip
        state["masters"] = [mine[i][0] for i in range(len(self.params))]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        masters = state_dict.get("masters")
        if masters is None or len(masters) != len(self.masters):
            got = "none" if masters is None else len(masters)
            raise ValueError(
                f"the checkpoint's optimizer state has no fp32 master weights for this draft (expected "
                f"{len(self.masters)}, got {got}): it was written with model.draft.master_weights=false or another "
                "draft; resume with the run's own settings, or start from its weights with model.draft.init_from"
            )
        with torch.no_grad():
            for i in self.owned:
                self.masters[i].copy_(masters[i])
        owned = set(self.owned)
        state = {int(i): s for i, s in state_dict["state"].items() if int(i) in owned}
        self.inner.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        for group, inner_group in zip(self.param_groups, self.inner.param_groups):
            group.update({k: v for k, v in inner_group.items() if k != "params"})
        self._masters_current = True


def owners(params: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[int]:
    """The rank of ``group`` that owns each parameter's master: largest first to the least loaded (0 without one)."""
    if group is None:
        return [0] * len(params)
    load, owner = [0] * dist.get_world_size(group), [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner[i] = min(range(len(load)), key=load.__getitem__)
        load[owner[i]] += params[i].numel()
    return owner
