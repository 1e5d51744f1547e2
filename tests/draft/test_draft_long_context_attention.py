"""``flash_lse`` as the long-context backend (§8): no ``[T,T]`` tensor for unpadded / right-padded batches.

* the tensor-free :class:`CausalBlock` rule is the eager mask's rule (element-wise), detected only for right padding;
* any other mask (left padding, holes) keeps the exact additive-mask path, == eager forward and backward;
* the whole TTT unroll with either block kernel == eager (loss, every step's output, every draft gradient; B = 2 with
  padding, K = 3, padding rows included);
* a TTT unroll at T = 1024 allocates no tensor of ``T²`` elements (forward and backward) with ``flash_lse``, while
  the eager twin does (so the check can fail);
* the diagonal columns run per chunk of slots: == eager forward and backward in fp64 for every chunk (1, one not
  dividing T, ≥ T), k = 0..3 and padded rows; no ``[k,B,n,T,d]`` stack of the later steps exists in the forward or
  backward (one chunk covering T does build it, so the check can fail); the saved tensors are the unchunked ones.
"""

from __future__ import annotations

import pytest
import torch
from test_draft_ttt_attention import assert_same, make_inputs, run, saved_shapes
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_eagle.draft import TTTCache
from lightning_eagle.draft import ttt_attention as tta
from lightning_eagle.draft.block_attention import ChunkedKernel, CpuFlashKernel
from lightning_eagle.draft.ttt_attention import eager_ttt_attention, flash_lse_ttt_attention
from lightning_eagle.ops.mla import causal_allowed_mask
from lightning_eagle.training import ttt_loss

KERNELS = pytest.mark.parametrize(
    "kernel", [CpuFlashKernel(), ChunkedKernel(chunk_size=3)], ids=["cpu_flash", "chunked"]
)


def bound(mask) -> TTTCache:
    cache = TTTCache()
    cache.bind_mask(mask)
    return cache


def masks_of(B=2, T=7):
    right = torch.ones(B, T, dtype=torch.long)
    right[1, 4:] = 0
    left = torch.ones(B, T, dtype=torch.long)
    left[1, :3] = 0
    hole = torch.ones(B, T, dtype=torch.long)
    hole[0, 2] = 0
    return {"right": right, "left": left, "hole": hole}


def test_causal_block_is_detected_for_right_padding_only():
    T = 7
    masks = masks_of(T=T)
    assert bound(None).causal_block(T, torch.device("cpu")).lengths is None
    assert bound(torch.ones(2, T, dtype=torch.long)).causal_block(T, torch.device("cpu")).lengths is None
    assert bound(masks["right"]).causal_block(T, torch.device("cpu")).lengths.tolist() == [7, 4]
    empty_row = masks["right"].clone()
    empty_row[0] = 0
    assert bound(empty_row).causal_block(T, torch.device("cpu")).lengths.tolist() == [0, 4]
    for name in ("left", "hole"):
        assert bound(masks[name]).causal_block(T, torch.device("cpu")) is None, name


@pytest.mark.parametrize("lengths", [None, [7, 4], [0, 1]], ids=["unpadded", "right", "near-empty"])
def test_causal_block_rule_equals_the_eager_mask(lengths):
    """Every query chunk's on-the-fly mask is the matching rows of causal_allowed_mask (keys past the chunk: none)."""
    T = 7
    mask = None if lengths is None else (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    rule = bound(mask).causal_block(T, torch.device("cpu"))
    full = causal_allowed_mask(mask, T, "cpu")
    for start, end in [(0, 3), (3, 6), (6, 7), (0, 7)]:
        chunk = rule.allowed(start, end, torch.device("cpu"))
        assert torch.equal(chunk.expand(full.shape[0], 1, end - start, end), full[:, :, start:end, :end])
        assert not full[:, :, start:end, end:].any()  # what the chunked kernel skips is masked anyway


@KERNELS
@pytest.mark.parametrize("padding", ["left", "hole"])
def test_other_padding_keeps_the_exact_masked_path(kernel, padding):
    mask = masks_of()[padding]
    inputs = make_inputs(2)

    def flash(q, cache, scale):
        out = flash_lse_ttt_attention(q, cache, scale, kernel=kernel)
        assert ("additive", 7, q.dtype, torch.device("cpu")) in cache._masks  # the [B,1,T,T] mask path
        return out

    assert_same(run(flash, *inputs, mask), run(eager_ttt_attention, *inputs, mask), 1e-12)


@KERNELS
def test_right_padding_builds_no_mask_tensor(kernel):
    inputs = make_inputs(3)
    mask = masks_of()["right"]
    caches = []

    def flash(q, cache, scale):
        caches.append(cache)
        return flash_lse_ttt_attention(q, cache, scale, kernel=kernel)

    assert_same(run(flash, *inputs, mask), run(eager_ttt_attention, *inputs, mask), 1e-12)
    assert list(caches[0]._masks) == [("causal_block", 7, torch.device("cpu"))]


@KERNELS
@pytest.mark.parametrize("diagonal_chunk", [tta.DEFAULT_DIAGONAL_CHUNK, 3], ids=["one-chunk", "chunk-3"])
def test_unrolled_ttt_loss_matches_eager_with_padding(make_draft, make_batch, monkeypatch, kernel, diagonal_chunk):
    """K = 3, B = 2 with 3 padding slots: loss, each step's output (padding rows too) and every draft gradient."""
    monkeypatch.setattr(tta, "default_kernel", lambda q: kernel)
    monkeypatch.setattr(tta, "DEFAULT_DIAGONAL_CHUNK", diagonal_chunk)  # read at call time; 3 does not divide T = 10
    draft = make_draft(dtype=torch.float64)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in make_batch(draft.config, T=10).items()}
    results = []
    for name in ("eager", "flash_lse"):
        draft.attention_backend = name
        draft.zero_grad(set_to_none=True)
        steps = []
        out = ttt_loss(draft, **batch, ttt_steps=3, draft_step_fn=recording(steps))
        out.loss.backward()
        grads = {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), steps, grads))
    (loss_a, steps_a, grads_a), (loss_b, steps_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-12)
    for a, b in zip(steps_a, steps_b, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def recording(outputs: list):
    def step(draft, input_ids, hidden, attention_mask, cache):
        out = draft.layer(input_ids, hidden, attention_mask, cache)
        outputs.append(out.detach())
        return out

    return step


class LargestAllocation(TorchDispatchMode):
    """The largest storage (in elements) any op produces while active: views share their base, expands cost 0."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                size = t.untyped_storage().nbytes() // t.element_size()
                if size > self.largest:
                    self.largest, self.op = size, func
        return out


def largest_in_unroll(draft, batch, steps=3) -> LargestAllocation:
    hidden = draft.project(batch["aux_hidden_states"])
    cache = TTTCache()
    with LargestAllocation() as mode:
        outs = []
        for k in range(steps):
            hidden = draft.layer(batch["input_ids"], hidden, batch["attention_mask"], cache)
            outs.append(hidden)
        sum((o * o).mean() for o in outs).backward()
    return mode


@pytest.mark.parametrize("kernel", [None, ChunkedKernel(chunk_size=64)], ids=["default", "chunked"])
@pytest.mark.parametrize("kv_cache", ["expanded", "latent"])
def test_no_t_by_t_tensor_in_a_long_unroll(make_draft, make_batch, monkeypatch, kernel, kv_cache):
    """T = 1024, B = 2 (one row right-padded): flash_lse's largest tensor is one per-token activation (the fused
    [B,T,2H] input), O(T) and below T² elements; the eager twin's is ≥ T² (its scores), so the bound can fail."""
    T = 1024
    if kernel is not None:
        monkeypatch.setattr(tta, "default_kernel", lambda q: kernel)
    draft = make_draft()
    draft.kv_cache = kv_cache
    batch = make_batch(draft.config, T=T, pad=300)
    draft.attention_backend = "flash_lse"
    flash = largest_in_unroll(draft, batch)
    c = draft.config
    widest_row = max(2 * c.hidden_size, c.intermediate_size, c.num_attention_heads * max(c.qk_head_dim, c.v_head_dim))
    assert flash.largest <= 2 * T * widest_row < T * T, (flash.largest, flash.op)  # B·T·(widest per-token tensor)
    if kernel is None and kv_cache == "expanded":
        draft.attention_backend = "eager"
        assert largest_in_unroll(draft, batch).largest >= T * T


@KERNELS
@pytest.mark.parametrize("chunk", [1, 3, 7, 64], ids=["chunk-1", "chunk-3", "chunk-T", "chunk-over-T"])
@pytest.mark.parametrize("steps", [0, 1, 2, 3])
@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_slot_chunked_diagonal_matches_eager(kernel, chunk, steps, padding):
    """T = 7 in chunks of 1, 3 (last chunk partial), 7 and 64 slots: output and the gradients of q and every cached
    K/V equal the eager twin's in fp64, padding rows included (right padding: CausalBlock; left: additive mask)."""
    mask = None if padding is None else masks_of()[padding]
    inputs = make_inputs(steps)

    def flash(q, cache, scale):
        return flash_lse_ttt_attention(q, cache, scale, kernel=kernel, chunk=chunk)

    assert_same(run(flash, *inputs, mask), run(eager_ttt_attention, *inputs, mask), 1e-12)


def attention_largest(chunk: int, steps: int, T: int) -> LargestAllocation:
    """The largest storage of one flash_lse call (forward + backward) over ``steps`` later steps (B=1, n=2)."""
    q, keys, values = long_inputs(steps, T)
    cache = TTTCache()
    cache.bind_mask(torch.ones(1, T, dtype=torch.long))
    for k, v in zip(keys, values):
        cache.append(k, v)
    with LargestAllocation() as mode:
        flash_lse_ttt_attention(q, cache, 0.3, kernel=CpuFlashKernel(), chunk=chunk).sum().backward()
    return mode


def long_inputs(steps, T, n=2, d_qk=24, d_v=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, T, d_qk, generator=g, dtype=torch.float64).requires_grad_()
    keys = [torch.randn(1, n, T, d_qk, generator=g, dtype=torch.float64).requires_grad_() for _ in range(steps + 1)]
    values = [torch.randn(1, n, T, d_v, generator=g, dtype=torch.float64).requires_grad_() for _ in range(steps + 1)]
    return q, keys, values


def test_no_stack_of_the_later_steps_in_forward_or_backward():
    """k = 3, T = 64, chunk 16: the largest tensor is one per-step [B,n,T,·] (the kernel's padded q/k/v/grads), below
    the [k,B,n,T,d_qk] stack the unchunked diagonal builds — which one chunk of 64 slots does build."""
    steps, T, n, d_qk = 3, 64, 2, 24
    per_step = n * T * d_qk  # B = 1
    chunked = attention_largest(16, steps, T)
    assert chunked.largest <= per_step, (chunked.largest, chunked.op)
    whole = attention_largest(T, steps, T)
    assert whole.largest >= steps * per_step, (whole.largest, whole.op)


def test_chunking_saves_the_same_tensors():
    """What the attention saves for backward does not depend on the chunk: q, K_0, V_0, the output, the LSE and each
    later step's K/V as they are (nothing O(k·T) added by the chunking)."""
    T_ = 64
    want = sorted([(1, 2, T_, 24)] * 5 + [(1, 2, T_, 16)] * 5 + [(1, 2, T_)])  # q, K_0..3 | V_0..3, out | lse
    for chunk in (1, 5, 64):
        shapes = saved_shapes(lambda q, c, s, chunk=chunk: flash_lse_ttt_attention(q, c, s, chunk=chunk), 3, T_)
        assert sorted(shapes) == want, chunk


def test_a_non_positive_chunk_is_refused():
    q, keys, values, _ = make_inputs(1)
    cache = TTTCache()
    for k, v in zip(keys, values):
        cache.append(k, v)
    with pytest.raises(ValueError, match="flash_lse diagonal chunk must be a positive number of slots, got chunk=0"):
        flash_lse_ttt_attention(q, cache, 0.3, chunk=0)
