"""The draft's parameters by role (:class:`DraftShapes`), counted by each family on its real module built on the
meta device (:attr:`~lightning_eagle.planning.family.PlanningFamily.draft_shapes`): what it holds, what it trains,
and (where the family's terms need it) in which order the backward produces the gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_eagle.parallel.memory import SkipInit


@dataclass(frozen=True)
class DraftShapes:
    """The draft's parameters (numel) by role, from the real module."""

    trainable: int
    frozen: int
    buffer_bytes: int  # EAGLE-3: d2t (int64) + t2d (bool)
    largest_trainable: int  # numel of the largest trainable parameter
    projection: int  # the input projection (EAGLE-3: fc + fc_norm, used once per unroll, not by every TTT step)
    groups: tuple[tuple[str, int, int], ...]  # (group, numel, largest numel) of the per-step trainables, backward order

    @property
    def unrolled(self) -> int:
        """Trainable numel used by every step of an unroll: autograd sums each one's gradients in one buffer."""
        return sum(numel for _, numel, _ in self.groups)


def on_meta(build):
    """``build()`` (a draft module) on the meta device, ``nn.init`` skipped: its shapes at no cost."""
    with torch.device("meta"), SkipInit():
        return build()
