"""Tiny random K3 targets and the EAGLE-3 drafts and DSpark drafters that fit them, for the inference tests."""

from __future__ import annotations

import torch
from k3_helpers import tiny_model

from lightning_eagle.draft import Eagle3DraftConfig, KimiK3Eagle3Draft, build_draft
from lightning_eagle.draft.dspark import DSparkDrafter
from lightning_eagle.draft.dspark_config import dspark_config_from_preset


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


def dspark_for_target(target, seed: int = 0, **overrides) -> DSparkDrafter:
    """A random ``k3-tiny`` DSpark drafter sized for ``target`` (its vocabulary, width and depth; the last token id
    is the mask), with norm weights away from 1."""
    tc = target.config
    values = {
        "vocab_size": tc.vocab_size,
        "mask_token_id": tc.vocab_size - 1,
        "target_hidden_size": tc.hidden_size,
        "target_num_hidden_layers": tc.num_hidden_layers,
        **overrides,
    }
    torch.manual_seed(seed)
    drafter = DSparkDrafter(dspark_config_from_preset("k3-tiny", **values))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return drafter.eval()


def train_dspark(
    target, drafter: DSparkDrafter, sequences, supervised_from, steps: int = 60, lr: float = 3e-3, anchors: int = 24
) -> DSparkDrafter:
    """A short real training of ``drafter`` with the DSpark objective (anchors, blocks, ``dspark_loss_plain``)
    against ``target``'s taps and teacher. ``sequences`` are token lists (right-padded here; padding is never
    supervised nor seen by an earlier block), supervised from position ``supervised_from[i]`` on."""
    # imported here: the other inference tests need no training code
    from lightning_eagle.training.dspark_anchors import anchor_generator, block_targets, sample_anchors
    from lightning_eagle.training.dspark_objective import DSparkHeads, dspark_loss_plain, supervised_rows

    config = drafter.config
    T = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (T - len(s)) for s in sequences])
    position = torch.arange(T)
    loss_mask = torch.stack([(position >= start) & (position < len(s)) for s, start in zip(sequences, supervised_from)])
    with torch.no_grad():
        cap = target.capture(ids, None, config.aux_layer_ids, config.aux_stream)
    heads = DSparkHeads(
        lm_head_weight=target.lm_head.weight,
        markov_w1=drafter.markov_head.markov_w1.weight,
        markov_w2=drafter.markov_head.markov_w2.weight,
        confidence_weight=drafter.confidence_head.proj.weight,
        confidence_bias=drafter.confidence_head.proj.bias,
    )
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    drafter.train()
    for step in range(steps):
        anchor_ids, keep = sample_anchors(loss_mask, anchors, anchor_generator(0, step, 0))
        blocks = block_targets(ids, loss_mask, anchor_ids, keep, config.block_size)
        hidden = drafter(cap.aux_hidden_states, ids, anchor_ids, keep, target.model.embed_tokens)
        loss = dspark_loss_plain(supervised_rows(blocks, hidden, cap.final_hidden), heads).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()
