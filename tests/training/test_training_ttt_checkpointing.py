"""Activation checkpointing of the TTT steps: the same loss and gradients, fewer tensors kept for the backward."""

from __future__ import annotations

import pytest
import torch

from lightning_eagle.training import ttt_loss
from lightning_eagle.training.ttt import checkpointed_draft_step, draft_step


def _run(draft, batch, step_fn):
    draft.zero_grad(set_to_none=True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        inputs = [batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "target_logits")]
        out = ttt_loss(draft, *inputs, ttt_steps=4, draft_step_fn=step_fn)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return out, grads, sum(saved)


@pytest.mark.parametrize("backend", ["eager", "flash_lse"])
def test_checkpointed_steps_give_the_same_loss_and_gradients(make_draft, make_batch, backend):
    draft = make_draft()
    draft.attention_backend = backend
    batch = make_batch(draft.config, T=24)
    plain, plain_grads, plain_bytes = _run(draft, batch, draft_step)
    ckpt, ckpt_grads, ckpt_bytes = _run(draft, batch, checkpointed_draft_step)
    torch.testing.assert_close(ckpt.loss, plain.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ckpt.per_step_loss, plain.per_step_loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(ckpt.per_step_correct, plain.per_step_correct)
    assert plain_grads.keys() == ckpt_grads.keys() and len(plain_grads) > 5
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert ckpt_bytes < 0.6 * plain_bytes, (ckpt_bytes, plain_bytes)  # what the backward keeps alive


def test_the_cache_grows_once_per_checkpointed_step(make_draft, make_batch):
    from lightning_eagle.draft.cache import TTTCache

    draft = make_draft()
    batch = make_batch(draft.config)
    cache, hidden = TTTCache(), draft.project(batch["aux_hidden_states"])
    for k in range(3):
        hidden = checkpointed_draft_step(draft, batch["input_ids"], hidden, batch["attention_mask"], cache)
        assert len(cache) == k + 1
    hidden.sum().backward()  # the recomputation appends to a replay, never to `cache`
    assert len(cache) == 3


def test_the_setting_reaches_the_draft_as_in_every_family(target_dir, make_batch):
    """``model.draft.activation_checkpointing`` is a drafter argument in both families: the module builds the EAGLE-3
    draft with it and its step hook recomputes exactly when the draft says so (same loss, fewer saved bytes)."""
    from eagle_helpers import eagle_module

    results = {}
    for flag in (False, True):
        module = eagle_module(target=str(target_dir), aux_layer_ids=[1, 3, 5], draft_activation_checkpointing=flag)
        draft = module._build_draft(None)
        assert draft.activation_checkpointing is flag
        torch.manual_seed(0)
        for p in draft.parameters():
            torch.nn.init.normal_(p, std=0.02)
        results[flag] = _run(draft, make_batch(draft.config), module.draft_step)
    (plain, plain_grads, plain_bytes), (ckpt, ckpt_grads, ckpt_bytes) = results[False], results[True]
    torch.testing.assert_close(ckpt.loss, plain.loss)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, msg=name)
    assert ckpt_bytes < plain_bytes
