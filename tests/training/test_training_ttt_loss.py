"""Loss (§6): soft CE divided by the supervised count, normalised step weights, K=1 == L_0, padding-density
invariance, the chunked-teacher route, and one end-to-end CPU training step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_eagle.training import soft_cross_entropy, step_weights, ttt_loss


def test_soft_cross_entropy_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(2, 5, 7, generator=g), -1)
    pos = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 1, 0, 0]], dtype=torch.bool)
    per = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(logits, probs, pos), per[pos].sum() / 4)


def test_all_masked_step_is_zero_with_zero_gradient():
    logits = torch.randn(1, 4, 7, requires_grad=True)
    loss = soft_cross_entropy(logits, torch.softmax(torch.randn(1, 4, 7), -1), torch.zeros(1, 4, dtype=torch.bool))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_step_weights_are_normalised(make_draft, make_batch):
    # exact: Python float powers rounded once to fp32 (no pow kernel involved)
    assert step_weights(4).tolist() == [1.0, 0.800000011920929, 0.6399999856948853, 0.5120000243186951]
    draft = make_draft()
    out = ttt_loss(draft, **make_batch(draft.config), ttt_steps=4, step_decay=0.5)
    w = torch.tensor([1.0, 0.5, 0.25, 0.125])
    torch.testing.assert_close(out.loss, (w * out.per_step_loss).sum() / w.sum())
    assert torch.equal(out.step_weights, w)


def test_one_step_run_equals_the_first_step_loss(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config)
    one, seven = ttt_loss(draft, **batch, ttt_steps=1), ttt_loss(draft, **batch)
    assert seven.per_step_loss.shape == (7,)  # ttt_steps defaults to settings.DEFAULT_TTT_STEPS (7)
    # exact: step 0 is the same computation on the same shapes whatever K is, and K=1 weighs it by 1/1
    assert torch.equal(one.loss, seven.per_step_loss[0]) and torch.equal(one.loss, one.per_step_loss[0])


def test_padding_density_does_not_change_the_loss(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config)
    supervised_logits = []

    def recording_loss(logits, probs, pos):
        supervised_logits.append(logits.detach()[pos])
        return soft_cross_entropy(logits, probs, pos)

    base = ttt_loss(draft, **batch, ttt_steps=4, step_loss_fn=recording_loss)
    # The padded run computes the draft logits through other shapes; its argmax counts can only be compared exactly
    # because no supervised slot has a near tie.
    best = torch.cat(supervised_logits).topk(2, -1).values
    assert (best[:, 0] - best[:, 1]).min() > 1e-4
    extra_cols, g = 9, torch.Generator().manual_seed(7)
    padded = {}
    for key, value in batch.items():
        shape = (value.shape[0], extra_cols, *value.shape[2:])
        if value.is_floating_point():
            fill = torch.randn(shape, generator=g)
        else:
            fill = torch.zeros(shape, dtype=value.dtype)
            if key == "input_ids":
                fill = torch.randint(0, 256, shape, generator=g)
        padded[key] = torch.cat([value, fill], dim=1)
    # one more row that is all padding
    padded = {k: torch.cat([v, torch.zeros_like(v[:1])], dim=0) for k, v in padded.items()}
    more = ttt_loss(draft, **padded, ttt_steps=4)
    torch.testing.assert_close(more.loss, base.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(more.per_step_loss, base.per_step_loss, rtol=1e-6, atol=1e-7)
    for name in ("per_step_correct", "per_step_valid", "step_prefix_hits", "step_valid"):
        assert torch.equal(getattr(more, name), getattr(base, name)), name


def test_final_hidden_route_equals_logits_route(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config)
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 12, 128, generator=g), torch.randn(256, 128, generator=g)
    batch["target_logits"] = F.linear(hidden, weight)
    a = ttt_loss(draft, **batch, ttt_steps=3)
    del batch["target_logits"]
    b = ttt_loss(draft, **batch, ttt_steps=3, final_hidden=hidden, lm_head_weight=weight)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.per_step_valid, b.per_step_valid) and torch.equal(a.per_step_correct, b.per_step_correct)


def test_one_cpu_training_step(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config)
    hidden = torch.randn(2, 12, 128, requires_grad=True)  # stand-ins for frozen target tensors
    weight = torch.randn(256, 128, requires_grad=True)
    del batch["target_logits"]
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, betas=(0.9, 0.95))
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    out = ttt_loss(draft, **batch, final_hidden=hidden, lm_head_weight=weight)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert hidden.grad is None and weight.grad is None  # the teacher is detached from the target
    assert draft.embed_tokens.weight.grad is None
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
    optimizer.step()
    assert torch.equal(draft.embed_tokens.weight, before["embed_tokens.weight"])
    assert not torch.equal(draft.fc.weight, before["fc.weight"])
    assert len(optimizer.state) == len(trainable) == len(before) - 1
