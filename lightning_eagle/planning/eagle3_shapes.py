"""The EAGLE-3 draft's parameters by role (:func:`eagle3_draft_shapes`), counted on the real
:class:`~lightning_eagle.draft.KimiK3Eagle3Draft` built on the meta device: what it holds, what it trains, and in
which order the backward produces the gradients."""

from __future__ import annotations

from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.planning.draft_shapes import DraftShapes, on_meta

# Trainable parameters by the order their gradients appear when one TTT step is back-propagated (the reverse of the
# forward): lm_head and the final norm, the MLP and its norm, the attention output projections, the rest of the layer.
_BACKWARD_GROUPS = {
    "head": ("lm_head.", "norm."),
    "mlp": ("midlayer.mlp.", "midlayer.post_attention_layernorm."),
    "attention output": ("midlayer.self_attn.o_proj.", "midlayer.self_attn.g_proj."),
    "attention input": ("midlayer.", "embed_tokens."),
}


def eagle3_draft_shapes(config: Eagle3DraftConfig) -> DraftShapes:
    """Build the real draft on the meta device (no init) and count its parameters by role."""
    from lightning_eagle.draft import KimiK3Eagle3Draft

    draft = on_meta(lambda: KimiK3Eagle3Draft(config))
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
