"""The draft's parameters by role, counted on the real module built on the meta device
(:class:`~lightning_eagle.draft.KimiK3Eagle3Draft`, or the DSpark drafter): what it holds, what it trains, and (EAGLE-3)
in which order the backward produces the gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.draft.dspark_config import DSparkDraftConfig
from lightning_eagle.parallel.memory import SkipInit

# Trainable parameters by the order their gradients appear when one TTT step is back-propagated (the reverse of the
# forward): lm_head and the final norm, the MLP and its norm, the attention output projections, the rest of the layer.
_BACKWARD_GROUPS = {
    "head": ("lm_head.", "norm."),
    "mlp": ("midlayer.mlp.", "midlayer.post_attention_layernorm."),
    "attention output": ("midlayer.self_attn.o_proj.", "midlayer.self_attn.g_proj."),
    "attention input": ("midlayer.", "embed_tokens."),
}


@dataclass(frozen=True)
class DraftShapes:
    """The draft's parameters (numel) by role, from the real module."""

    trainable: int
    frozen: int
    buffer_bytes: int  # d2t (int64) + t2d (bool)
    largest_trainable: int  # numel of the largest trainable parameter
    projection: int  # fc (+ fc_norm): used once per unroll, not by every TTT step
    groups: tuple[tuple[str, int, int], ...]  # (group, numel, largest numel) of the per-step trainables, backward order

    @property
    def unrolled(self) -> int:
        """Trainable numel used by every TTT step: autograd sums each one's K gradients in one buffer."""
        return sum(numel for _, numel, _ in self.groups)


def draft_shapes(config: Eagle3DraftConfig) -> DraftShapes:
    """Build the real draft on the meta device (no init) and count its parameters by role."""
    from lightning_eagle.draft import KimiK3Eagle3Draft

    with torch.device("meta"), SkipInit():
        draft = KimiK3Eagle3Draft(config)
    trainable = {n: p.numel() for n, p in draft.named_parameters() if p.requires_grad}
    grouped: dict[str, list[int]] = {g: [] for g in _BACKWARD_GROUPS}
    projection = 0
    for name, numel in trainable.items():
        group = next((g for g, prefixes in _BACKWARD_GROUPS.items() if name.startswith(prefixes)), None)
        if group is None:  # fc, fc_norm
            projection += numel
        else:
            grouped[group].append(numel)
    return DraftShapes(
        trainable=sum(trainable.values()),
        frozen=sum(p.numel() for p in draft.parameters() if not p.requires_grad),
        buffer_bytes=sum(b.numel() * b.element_size() for b in draft.buffers()),
        largest_trainable=max(trainable.values(), default=0),
        projection=projection,
        groups=tuple((g, sum(sizes), max(sizes, default=0)) for g, sizes in grouped.items()),
    )


def dspark_draft_shapes(config: DSparkDraftConfig) -> DraftShapes:
    """The DSpark drafter's parameters, from the real module on meta: all trained (the embedding and ``lm_head`` are
    the target's, not the drafter's); ``projection`` is ``context_proj``. Its backward is a census, not groups."""
    from lightning_eagle.draft.dspark import DSparkDrafter

    with torch.device("meta"), SkipInit():
        drafter = DSparkDrafter(config)
    sizes = {n: p.numel() for n, p in drafter.named_parameters()}
    return DraftShapes(
        trainable=sum(sizes.values()), frozen=0, buffer_bytes=0, largest_trainable=max(sizes.values()),
        projection=sizes["context_proj.weight"], groups=(),
    )  # fmt: skip


def shapes_of(config: Eagle3DraftConfig | DSparkDraftConfig) -> DraftShapes:
    """The :class:`DraftShapes` of either family's config."""
    return dspark_draft_shapes(config) if isinstance(config, DSparkDraftConfig) else draft_shapes(config)
