"""Tiny random K3 targets and EAGLE-3 drafts that fit them, for the inference tests."""

from __future__ import annotations

import torch
from k3_helpers import tiny_model

from lightning_eagle.draft import Eagle3DraftConfig, KimiK3Eagle3Draft, build_draft


def make_target(preset: str = "k3-tiny", seed: int = 0, lm_head_scale: float = 1.0, **overrides):
    """A frozen random tiny K3; ``lm_head_scale`` sharpens its next-token distributions."""
    model = tiny_model(preset, seed=seed, **overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    return model


def draft_for_target(
    target,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    lm_head_scale: float = 1.0,
    aux_layer_ids=(1, 3, 5),
    **overrides,
) -> KimiK3Eagle3Draft:
    """A random draft for ``target`` with non-trivial norm weights, a non-prefix vocabulary map (when
    ``draft_vocab_size`` < V) and the target's embedding."""
    values = {"draft_vocab_size": draft_vocab_size, "intermediate_size": 64}
    if aux_layer_ids is not None:
        values["aux_layer_ids"] = list(aux_layer_ids)
    values.update(overrides)
    config = Eagle3DraftConfig.from_target_config(target.config, **values)
    torch.manual_seed(seed)
    draft = build_draft(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
        draft.lm_head.weight.mul_(lm_head_scale)
        V, N_d = config.vocab_size, config.draft_vocab_size
        if N_d < V:
            draft.set_vocab_mapping(torch.sort(torch.randperm(V)[:N_d]).values)
        draft.copy_embeddings_from(target.model.embed_tokens.weight)
    return draft.eval()
