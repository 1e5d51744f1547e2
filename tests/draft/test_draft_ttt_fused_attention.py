"""Concatenated-key TTT attention backends (§8) against the eager twin, and the per-device choice.

* ``sdpa_mask`` trains on CPU: forward *and* backward (q, every cached K/V) == eager.
* ``flex_attention`` has no CPU backward in torch 2.13: its mask is checked element-wise against the boolean mask,
  its forward against eager, and its refusal of gradients (and torch's own) is asserted, so that a torch upgrade that
  lifts the limit makes this file fail and the backward test get written.
* ``auto`` resolves per device at call time.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_draft_ttt_attention import assert_same, make_inputs, padding_mask, run
from torch.nn.attention.flex_attention import create_mask, flex_attention

from lightning_eagle import backends
from lightning_eagle.draft import TTTCache
from lightning_eagle.draft import ttt_attention as tta
from lightning_eagle.draft.ttt_attention import (
    eager_ttt_attention,
    flash_lse_ttt_attention,
    flex_ttt_attention,
    sdpa_mask_ttt_attention,
    ttt_boolean_mask,
    ttt_mask_mod,
)
from lightning_eagle.training import ttt_loss
from lightning_eagle.training.ttt import checkpointed_draft_step

DIMS = pytest.mark.parametrize("dims", [(24, 16), (16, 24), (20, 20)], ids=["dqk>dv", "dqk<dv", "equal"])


def filled_cache(keys, values, mask) -> TTTCache:
    cache = TTTCache()
    cache.bind_mask(mask)
    for k, v in zip(keys, values):
        cache.append(k, v)
    return cache


# ---- sdpa_mask ----------------------------------------------------------------------------------------------------
@DIMS
@pytest.mark.parametrize("steps", [0, 1, 2, 6])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_sdpa_mask_matches_eager_forward_and_backward(dims, steps, padded):
    inputs = make_inputs(steps, *dims)
    mask = padding_mask() if padded else None
    assert_same(run(sdpa_mask_ttt_attention, *inputs, mask), run(eager_ttt_attention, *inputs, mask), 1e-12)


def test_sdpa_mask_fp32():
    inputs = make_inputs(3, dtype=torch.float32, seed=2)
    assert_same(
        run(sdpa_mask_ttt_attention, *inputs, padding_mask()), run(eager_ttt_attention, *inputs, padding_mask()), 2e-6
    )


def test_boolean_mask_layout():
    """Block = causal ∧ key-not-pad (padding query rows: key 0 only), then one identity block per later step."""
    keys, values = make_inputs(2)[1:3]
    cache = filled_cache(keys, values, padding_mask())
    T = keys[0].shape[-2]
    mask = ttt_boolean_mask(cache, T, torch.device("cpu"))
    assert mask.shape == (2, 1, T, 3 * T) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0, :, :T], torch.ones(T, T, dtype=torch.bool).tril())
    assert mask[1, 0, 6, :T].tolist() == [True] + [False] * (T - 1)  # a padding query row
    assert not mask[1, 0, :, 5:T].any()  # padding keys of row 1
    for step in (1, 2):
        assert torch.equal(mask[:, 0, :, step * T : (step + 1) * T], torch.eye(T, dtype=torch.bool).expand(2, T, T))


# ---- flex_attention -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_flex_mask_mod_equals_the_boolean_mask(steps, padded):
    """The mask_mod the CUDA kernel evaluates, densely on CPU, is exactly the boolean mask of sdpa_mask."""
    keys, values = make_inputs(steps)[1:3]
    mask = padding_mask() if padded else None
    cache = filled_cache(keys, values, mask)
    T = keys[0].shape[-2]
    batch = 1 if mask is None else mask.shape[0]
    dense = create_mask(ttt_mask_mod(mask, T), batch, 1, T, T * (steps + 1), device="cpu")
    expected = ttt_boolean_mask(cache, T, torch.device("cpu")).expand(batch, 1, T, T * (steps + 1))
    assert torch.equal(dense, expected)


@DIMS
@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flex_forward_matches_eager_on_cpu(dims, steps, dtype):
    q, keys, values, _ = make_inputs(steps, *dims, dtype=dtype)
    for mask in (padding_mask(), None):
        cache = filled_cache(keys, values, mask)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
            got = flex_ttt_attention(q, cache, 0.3)
            want = eager_ttt_attention(q, cache, 0.3)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12 if dtype == torch.float64 else 2e-6)


def test_flex_refuses_gradients_on_cpu_like_torch_does():
    q, keys, values, weight = make_inputs(2)
    with pytest.raises(NotImplementedError, match="no backward on CPU"):
        run(flex_ttt_attention, q, keys, values, weight, padding_mask())
    # The refusal mirrors torch 2.13 itself; when torch gains a CPU flex backward this fails (test it then).
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, torch.cat(keys, -2), torch.cat(values, -2))


# ---- the per-device choice ----------------------------------------------------------------------------------------
def test_default_backend_per_device(monkeypatch):
    assert backends.default_ttt_attention("cpu") == "flash_lse"
    assert not backends.flex_attention_available("cpu")
    monkeypatch.setattr(backends, "flex_attention_available", lambda device: True)
    assert backends.default_ttt_attention(torch.device("cuda", 0)) == "flex_attention"
    monkeypatch.setattr(backends, "flex_attention_available", lambda device: False)
    assert backends.default_ttt_attention("cuda") == "sdpa_mask"
    # a device that is not this machine's (the memory plan's GPUs): the Triton fact is given, not asked
    assert backends.default_ttt_attention("cuda", flex_available=True) == "flex_attention"


def test_auto_resolves_at_call_time(monkeypatch):
    inputs = make_inputs(2)
    auto = tta.get_ttt_attention("auto")
    out, grads = run(auto, *inputs, padding_mask())
    want_out, want_grads = run(flash_lse_ttt_attention, *inputs, padding_mask())
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    monkeypatch.setattr(backends, "default_ttt_attention", lambda device, **facts: "sdpa_mask")
    out, grads = run(auto, *inputs, padding_mask())
    want_out, want_grads = run(sdpa_mask_ttt_attention, *inputs, padding_mask())
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))


# ---- in the draft ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["sdpa_mask", "auto"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_draft_ttt_loss_matches_eager(make_draft, make_batch, backend, checkpointed):
    """The whole unroll (K = 3) with the backend: same loss and parameter gradients as eager (replays of a
    checkpointed step reuse the cache's derived masks)."""
    draft = make_draft(dtype=torch.float64)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in make_batch(draft.config, T=10).items()}
    results = []
    for name in ("eager", backend):
        draft.attention_backend = name
        draft.zero_grad(set_to_none=True)
        kwargs = {"draft_step_fn": checkpointed_draft_step} if checkpointed else {}
        out = ttt_loss(draft, **batch, ttt_steps=3, **kwargs)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-12)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-10, atol=1e-12, msg=name)
