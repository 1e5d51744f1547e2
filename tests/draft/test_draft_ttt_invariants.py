"""§4.4 invariants of the TTT unroll, for both attention backends: step 0 is plain causal MLA, the cache matters,
causality (later ids / aux / padding never reach slot t), the attention mask is constant, and the two backends agree on
a whole draft (forward and parameter gradients)."""

from __future__ import annotations

import pytest
import torch

from lightning_eagle.draft import TTTCache
from lightning_eagle.ops.mla import causal_additive_mask

BACKENDS = ["eager", "flash_lse"]


def shift(x):
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def unroll(draft, input_ids, aux, attention_mask, steps):
    cache = TTTCache()
    h, ids, outs = draft.project(aux), input_ids, []
    for k in range(steps):
        if k:
            ids = shift(ids)
        h = draft.layer(ids, h, attention_mask, cache)
        outs.append(h)
    assert len(cache) == steps
    return outs


@pytest.mark.parametrize("backend", BACKENDS)
def test_step0_is_plain_causal_mla(make_draft, make_batch, backend):
    draft = make_draft()
    draft.attention_backend = backend
    batch = make_batch(draft.config)
    layer, am = draft.midlayer, batch["attention_mask"]
    with torch.no_grad():
        combined = layer.combine(draft.embed(batch["input_ids"]), draft.project(batch["aux_hidden_states"]))
        cache = TTTCache()
        cache.bind_mask(am)
        ours = layer.attention(combined, cache, backend)
        plain = layer.self_attn(combined, causal_additive_mask(am, 12, torch.float32, "cpu"))
    real = am.bool()
    torch.testing.assert_close(ours[real], plain[real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_cache_matters(make_draft, make_batch, backend):
    """A K-step unroll differs from K independent step-0 runs on the same inputs (each with an empty cache)."""
    draft = make_draft()
    draft.attention_backend = backend
    batch = make_batch(draft.config)
    am = batch["attention_mask"]
    with torch.no_grad():
        chained = unroll(draft, batch["input_ids"], batch["aux_hidden_states"], am, 3)
        h, ids = draft.project(batch["aux_hidden_states"]), batch["input_ids"]
        for k in range(3):
            if k:
                ids = shift(ids)
            h = draft.layer(ids, h, am, TTTCache())
            if k == 0:  # exact: step 0 is the identical computation (empty cache, same shapes)
                torch.testing.assert_close(h, chained[0], rtol=0, atol=0)
    assert not torch.allclose(h, chained[2], atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causality(make_draft, make_batch, backend):
    """Step-k output at slot t depends only on shifted ids [0, t+k] and aux rows [0, t]; padding never leaks."""
    draft = make_draft()
    draft.attention_backend = backend
    batch = make_batch(draft.config)
    ids, aux, am = batch["input_ids"], batch["aux_hidden_states"], batch["attention_mask"]
    steps, T = 4, ids.shape[1]
    # exact throughout: same shapes, and masked (future or padding) inputs reach a slot only as exact zero weights
    with torch.no_grad():
        base = unroll(draft, ids, aux, am, steps)
        t = 4
        for k in range(steps):
            ids2, aux2 = ids.clone(), aux.clone()
            ids2[:, t + k + 1 :] = (ids2[:, t + k + 1 :] + 7) % draft.config.vocab_size
            aux2[:, t + 1 :] += 1.0
            out = unroll(draft, ids2, aux2, am, steps)[k]
            assert torch.equal(out[:, : t + 1], base[k][:, : t + 1]), f"step {k} leaks future inputs into slot {t}"
            assert not torch.allclose(out[:, t + 1 :], base[k][:, t + 1 :])  # the perturbation is visible later on
        pad = ~am.bool()
        ids3, aux3 = ids.clone(), aux.clone()
        ids3[pad] = (ids3[pad] + 11) % draft.config.vocab_size
        aux3[pad] = torch.randn_like(aux3[pad])
        for k, out in enumerate(unroll(draft, ids3, aux3, am, steps)):
            real = am.bool().clone()
            real[:, T - k :] = False  # slots whose shifted ids already read into the padding
            real[1, 9 - k :] = False
            assert torch.equal(out[real], base[k][real]), f"padding leaks into real slots at step {k}"


def test_attention_mask_must_stay_constant(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config)
    am = batch["attention_mask"]
    cache = TTTCache()
    h = draft.layer(batch["input_ids"], draft.project(batch["aux_hidden_states"]), am, cache)
    draft.layer(batch["input_ids"], h, am.clone(), cache)  # same values, other object: fine
    shrunk = am.clone()
    shrunk[0, -1] = 0
    with pytest.raises(ValueError, match="constant across steps"):
        draft.layer(batch["input_ids"], h, shrunk, cache)


def test_backends_agree_on_a_whole_draft(make_draft, make_batch):
    """float64 draft: the TTT loss and every parameter gradient agree to ~1e-12 between eager and flash_lse."""
    from lightning_eagle.training import ttt_loss

    draft = make_draft(dtype=torch.float64)
    batch = make_batch(draft.config)
    batch["aux_hidden_states"] = batch["aux_hidden_states"].double()
    grads = {}
    for backend in BACKENDS:
        draft.attention_backend = backend
        draft.zero_grad(set_to_none=True)
        out = ttt_loss(draft, **batch, ttt_steps=5)
        out.loss.backward()
        grads[backend] = (
            out.loss.detach(),
            {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad},
        )
    (loss_a, ga), (loss_b, gb) = grads["eager"], grads["flash_lse"]
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=1e-12)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
