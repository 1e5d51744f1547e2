"""A k3-tiny draft (N_d = 72 of V = 256) and a right-padded post-shift batch, shared by the draft and TTT tests."""

from __future__ import annotations

import torch

from lightning_eagle.draft import Eagle3DraftConfig, KimiK3Eagle3Draft, build_draft
from lightning_eagle.k3.presets import config_from_name


def tiny_config(**overrides) -> Eagle3DraftConfig:
    values = {"draft_vocab_size": 72, "aux_layer_ids": [1, 3, 5]}
    values.update(overrides)
    return Eagle3DraftConfig.from_target_config(config_from_name("k3-tiny"), **values)


def tiny_draft(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> KimiK3Eagle3Draft:
    torch.manual_seed(seed)
    draft = build_draft(tiny_config(**overrides))
    with torch.no_grad():
        # Non-trivial norm weights and a non-prefix vocabulary map, so that mix-ups cannot pass by coincidence.
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or "fc_norm" in name:
                p.uniform_(0.5, 1.5)
        selected = torch.sort(torch.randperm(draft.config.vocab_size)[: draft.config.draft_vocab_size]).values
        draft.set_vocab_mapping(selected)
    return draft.to(dtype)


def tiny_batch(config: Eagle3DraftConfig, B: int = 2, T: int = 12, pad: int = 3, seed: int = 1) -> dict:
    """Right-padded post-shift batch: row 1 has ``pad`` padding slots; loss mask on a middle span."""
    g = torch.Generator().manual_seed(seed)
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, T - pad :] = 0
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask[:, 2 : T - 1] = 1
    loss_mask = loss_mask * attention_mask
    return {
        "input_ids": torch.randint(0, config.vocab_size, (B, T), generator=g),
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "aux_hidden_states": torch.randn(B, T, 3 * config.target_hidden_size, generator=g),
        "target_logits": 3 * torch.randn(B, T, config.vocab_size, generator=g),
    }


def reference_state(draft) -> dict:
    """``draft``'s state dict under the NeMo Automodel reference export's key names (``model.layers.0.*``)."""
    state = {}
    for key, value in draft.state_dict().items():
        if key.startswith("midlayer."):
            key = "model.layers.0." + key[len("midlayer.") :]
        elif key not in ("lm_head.weight", "d2t", "t2d"):
            key = "model." + key
        state[key] = value.clone()
    return state
