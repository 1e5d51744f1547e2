"""The chunked loss backend (``ttt_loss(loss_backend="chunked")``, `eagle3_training.md` §5.2, §6.1): the chunked
teacher equals the full teacher, and the fused chunked lm_head + soft CE equals the plain twin — loss, per-step
losses, every count, the argmax and the gradient of every draft parameter — on the golden draft and batch and on
random tiny configs (both teacher sources, padding, K >= 3, checkpointed steps, chunk sizes that do not divide the
slot count), while keeping no ``[*, N_d]`` tensor for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lightning_eagle.backends import LOSS_BACKEND, default_loss_backend
from lightning_eagle.draft import KimiK3Eagle3Draft
from lightning_eagle.training import soft_cross_entropy, ttt_loss
from lightning_eagle.training.teacher import (
    ChunkedTeacher,
    chunked_teacher_from_hidden,
    chunked_teacher_from_logits,
    compute_teacher,
    teacher_from_hidden,
    teacher_from_logits,
)
from lightning_eagle.training.ttt import checkpointed_draft_step, draft_step

COUNTS = ("per_step_correct", "per_step_valid", "step_prefix_hits", "step_valid")


def _vocab(V=256, N=72, seed=0):
    selected = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:N]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    return selected, t2d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_teacher_equals_the_full_teacher(dtype):
    g = torch.Generator().manual_seed(3)
    selected, t2d = _vocab()
    # A 1/16 grid: every logit is exact in fp32 whatever the GEMM tiling, so argmax comparisons are exact, ties included
    hidden = (torch.randint(-8, 9, (2, 11, 128), generator=g) / 16).to(dtype)
    weight = (torch.randint(-8, 9, (256, 128), generator=g) / 16).to(dtype)
    lm = (torch.rand(2, 11, generator=g) > 0.3).long()
    full = teacher_from_logits(F.linear(hidden, weight), selected, t2d, lm)
    by_hidden = teacher_from_hidden(hidden, weight, selected, t2d, lm, vocab_chunk=37)
    a = chunked_teacher_from_logits(F.linear(hidden, weight), selected, t2d, lm, seq_chunk=5)
    b = chunked_teacher_from_hidden(hidden, weight, selected, t2d, lm, vocab_chunk=37, seq_chunk=5)  # 37 ∤ 256
    rows = torch.arange(22)
    for teacher in (a, b):
        assert isinstance(teacher, ChunkedTeacher) and not hasattr(teacher, "probs")
        assert torch.equal(teacher.top, full.top) and torch.equal(teacher.pos, full.pos)
        assert torch.equal(teacher.draft_argmax, full.probs.argmax(-1))
        probs = teacher.probs_at(rows)
        assert probs.dtype == torch.float32 and not probs.requires_grad
        torch.testing.assert_close(probs, full.probs.view(22, -1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(teacher.probs_block(1, 3, 9), full.probs[1, 3:9], rtol=1e-5, atol=1e-6)
    assert torch.equal(b.draft_argmax, by_hidden.probs.argmax(-1))  # the same tiles, the same values
    assert b.source.shape == (2, 11, 128) and b.head.shape == (72, 128) and b.head.dtype == dtype
    assert torch.equal(b.head, weight[selected])


def test_compute_teacher_chunked_from_both_sources(make_draft):
    draft = make_draft()
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 7, 128, generator=g), torch.randn(256, 128, generator=g)
    lm = torch.ones(2, 7)
    a = compute_teacher(draft, lm, target_logits=F.linear(hidden, weight), chunked=True)
    b = compute_teacher(draft, lm, final_hidden=hidden, lm_head_weight=weight, chunked=True, vocab_chunk=100)
    plain = compute_teacher(draft, lm, target_logits=F.linear(hidden, weight))
    assert isinstance(a, ChunkedTeacher) and isinstance(b, ChunkedTeacher)
    assert torch.equal(a.top, b.top) and torch.equal(a.pos, b.pos) and torch.equal(a.top, plain.top)
    torch.testing.assert_close(b.probs_at(torch.arange(14)), plain.probs.view(14, -1), rtol=1e-5, atol=1e-6)


def _prepare(draft, batch, source, ttt_steps):
    """The batch with a teacher the draft partly agrees with (so that hit counts and prefix chains are non-trivial),
    as target logits or as (final hidden, lm_head weight) = (those logits, identity).

    The draft's greedy ids do not depend on the teacher: slots t = 0, K, 2K, … get their step-k id boosted in teacher
    row t+k for every k, which gives those slots full prefix chains (rows of different slots never overlap)."""
    batch = dict(batch)
    with torch.no_grad():
        preds = ttt_loss(draft, **batch, ttt_steps=ttt_steps, return_argmax=True).draft_argmax  # [K,B,T] draft ids
    logits = batch["target_logits"].clone()
    B, T, _ = logits.shape
    selected = draft.selected_token_ids
    for t in range(0, T - ttt_steps + 1, ttt_steps):
        for k in range(ttt_steps):
            logits[torch.arange(B), t + k, selected[preds[k, :, t]]] += 20.0
    if source == "hidden":
        del batch["target_logits"]
        batch.update(final_hidden=logits, lm_head_weight=torch.eye(logits.shape[-1]))
    else:
        batch["target_logits"] = logits
    return batch


def _run(draft, batch, backend, **kwargs):
    draft.zero_grad(set_to_none=True)
    out = ttt_loss(draft, **batch, loss_backend=backend, return_argmax=True, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return out, grads


def _assert_twins(plain, chunked, plain_grads, chunked_grads, loss_tol=(1e-6, 1e-6), grad_rel=1e-5, exact=True):
    rtol, atol = loss_tol
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(chunked.per_step_loss, plain.per_step_loss, rtol=rtol, atol=atol)
    assert torch.equal(chunked.teacher.top, plain.teacher.top) and torch.equal(chunked.teacher.pos, plain.teacher.pos)
    if exact:  # fp32 logits through other GEMM shapes: no near tie here, so the argmax and counts are exact
        for name in COUNTS:
            assert torch.equal(getattr(chunked, name), getattr(plain, name)), name
        assert torch.equal(chunked.draft_argmax, plain.draft_argmax)
        torch.testing.assert_close(chunked.tau_sim, plain.tau_sim, rtol=0, atol=0)
    else:  # bf16 logits tie often; another GEMM blocking may break a tie the other way on some CPU
        assert (chunked.draft_argmax == plain.draft_argmax).float().mean() > 0.95
        for name in COUNTS:
            assert (getattr(chunked, name) - getattr(plain, name)).abs().max() <= 2, name
    assert plain_grads.keys() == chunked_grads.keys() and len(plain_grads) > 5
    for name, grad in plain_grads.items():
        rel = float((chunked_grads[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-30))
        assert rel < grad_rel, f"{name}: relative gradient error {rel:.2e}"


@pytest.mark.parametrize(
    ("source", "step_fn", "overrides"),
    [
        ("logits", draft_step, {}),
        ("hidden", draft_step, {}),
        ("logits", checkpointed_draft_step, {}),
        ("hidden", checkpointed_draft_step, {"fc_norm": True}),
        ("logits", draft_step, {"norm_output": True}),
        ("hidden", draft_step, {"architecture": "deepseek_mla"}),
    ],
)
def test_chunked_equals_plain_forward_and_backward(make_draft, make_batch, source, step_fn, overrides):
    draft = make_draft(**overrides)
    batch = make_batch(draft.config, B=3, T=14, pad=4)
    batch["loss_mask"][2, 1:6] = 1  # a third row with its own supervised span
    batch = _prepare(draft, batch, source, ttt_steps=4)
    kwargs = {"ttt_steps": 4, "draft_step_fn": step_fn}
    plain, plain_grads = _run(draft, batch, "plain", **kwargs)
    assert int(plain.per_step_valid.sum()) > 20 and int(plain.step_prefix_hits[-1]) > 0  # counts that can differ
    assert (plain.per_step_correct < plain.per_step_valid).all()
    for chunk in (5, 4096):  # 5 divides no step's slot count; 4096 is one chunk
        chunked, chunked_grads = _run(draft, batch, "chunked", loss_chunk=chunk, **kwargs)
        assert isinstance(chunked.teacher, ChunkedTeacher)
        _assert_twins(plain, chunked, plain_grads, chunked_grads)


def test_chunked_equals_plain_in_fp64(make_draft, make_batch):
    # fp64 weights and activations; both twins take the log-softmax in fp32, so only the summation order differs
    draft = make_draft(dtype=torch.float64)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in make_batch(draft.config, B=2, T=16).items()}
    batch = _prepare(draft, batch, "logits", ttt_steps=3)
    plain, plain_grads = _run(draft, batch, "plain", ttt_steps=3)
    chunked, chunked_grads = _run(draft, batch, "chunked", ttt_steps=3, loss_chunk=3)
    _assert_twins(plain, chunked, plain_grads, chunked_grads, grad_rel=1e-6)


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_chunked_equals_plain_in_bf16_and_under_autocast(make_draft, make_batch, mode):
    draft = make_draft(dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    batch = make_batch(draft.config, B=3, T=16)
    if mode == "bf16":
        batch = {k: v.bfloat16() if v.is_floating_point() else v for k, v in batch.items()}
    batch = _prepare(draft, batch, "logits", ttt_steps=3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        plain, plain_grads = _run(draft, batch, "plain", ttt_steps=3)
        chunked, chunked_grads = _run(draft, batch, "chunked", ttt_steps=3, loss_chunk=5)
    assert draft.lm_head.weight.grad.dtype == draft.lm_head.weight.dtype
    # bf16 logits / gradients: the twins round in other places (fp32 accumulation over chunks vs one GEMM)
    _assert_twins(plain, chunked, plain_grads, chunked_grads, loss_tol=(1e-5, 1e-5), grad_rel=2e-2, exact=False)


def test_chunked_equals_plain_and_golden_on_the_golden_batch(golden_dir):
    path = golden_dir / "draft"
    batch, exp = load_file(str(path / "batch.safetensors")), load_file(str(path / "expected.safetensors"))
    draft = KimiK3Eagle3Draft.from_pretrained(path / "export", attention_backend="flash_lse")
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "target_logits")}
    plain, plain_grads = _run(draft, inputs, "plain", ttt_steps=7)
    chunked, chunked_grads = _run(draft, inputs, "chunked", ttt_steps=7, loss_chunk=50)
    _assert_twins(plain, chunked, plain_grads, chunked_grads)
    torch.testing.assert_close(chunked.per_step_loss.detach(), exp["per_step_loss"], rtol=1e-4, atol=1e-5)
    assert chunked.per_step_correct.tolist() == exp["per_step_correct"].long().tolist()
    assert chunked.step_prefix_hits.tolist() == exp["step_prefix_hits"].tolist()


def test_no_grad_run_equals_plain(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config, T=16)
    with torch.no_grad():
        plain = ttt_loss(draft, **batch, ttt_steps=3)
        chunked = ttt_loss(draft, **batch, ttt_steps=3, loss_backend="chunked", loss_chunk=4)
    torch.testing.assert_close(chunked.per_step_loss, plain.per_step_loss, rtol=1e-6, atol=1e-6)
    for name in COUNTS:
        assert torch.equal(getattr(chunked, name), getattr(plain, name)), name
    assert chunked.draft_argmax is None and not chunked.loss.requires_grad


def test_all_masked_steps_are_zero_with_zero_gradient(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config, T=8)
    batch["loss_mask"][:] = 0
    batch["loss_mask"][1, :3] = 1  # teacher rows 0-2 only: step k reads rows >= k, so steps >= 3 have no slot
    plain, plain_grads = _run(draft, batch, "plain", ttt_steps=5)
    chunked, chunked_grads = _run(draft, batch, "chunked", ttt_steps=5, loss_chunk=2)
    assert plain.per_step_valid.tolist()[3:] == [0, 0] and chunked.per_step_loss.tolist()[3:] == [0.0, 0.0]
    _assert_twins(plain, chunked, plain_grads, chunked_grads)


def _saved_shapes(draft, batch, backend):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ttt_loss(draft, **batch, ttt_steps=3, loss_backend=backend, loss_chunk=8)
    out.loss.backward()
    return shapes, out


def test_chunked_keeps_no_draft_vocabulary_tensor_for_the_backward(make_draft, make_batch):
    draft = make_draft()
    N_d = draft.config.draft_vocab_size
    batch = make_batch(draft.config, T=16)
    g = torch.Generator().manual_seed(2)
    del batch["target_logits"]
    batch.update(final_hidden=torch.randn(2, 16, 128, generator=g), lm_head_weight=torch.randn(256, 128, generator=g))
    plain_shapes, _ = _saved_shapes(draft, batch, "plain")
    assert any(s[-1] == N_d and len(s) == 3 for s in plain_shapes)  # the plain twin keeps [B,T,N_d] logits
    shapes, out = _saved_shapes(draft, batch, "chunked")
    assert (N_d, draft.config.hidden_size) in shapes  # lm_head.weight, the only [N_d, *] tensor
    assert not any(N_d in s for s in shapes if s != (N_d, draft.config.hidden_size)), shapes
    teacher = out.teacher  # O(B·T) results, the source by reference and lm_head_weight[selected]
    assert teacher.top.shape == teacher.pos.shape == teacher.draft_argmax.shape == (2, 16)
    assert teacher.source.data_ptr() == batch["final_hidden"].data_ptr()  # a detached view, not a copy
    assert teacher.head.shape == (N_d, 128)


def test_chunked_refusals(make_draft, make_batch):
    draft = make_draft()
    batch = make_batch(draft.config)
    with pytest.raises(ValueError, match="loss_backend must be one of auto, plain, chunked"):
        ttt_loss(draft, **batch, loss_backend="fused")

    def my_loss(logits, probs, pos):
        return soft_cross_entropy(logits, probs, pos)

    with pytest.raises(ValueError, match="computes the soft cross-entropy itself.*my_loss.*loss_backend='plain'"):
        ttt_loss(draft, **batch, loss_backend="chunked", step_loss_fn=my_loss)
    plain_teacher = compute_teacher(draft, batch["loss_mask"], target_logits=batch["target_logits"])
    with pytest.raises(TypeError, match="needs a ChunkedTeacher, got Teacher"):
        ttt_loss(draft, **batch, loss_backend="chunked", teacher=plain_teacher)
    chunked_teacher = compute_teacher(draft, batch["loss_mask"], target_logits=batch["target_logits"], chunked=True)
    with pytest.raises(TypeError, match="needs a Teacher, got ChunkedTeacher"):
        ttt_loss(draft, **batch, teacher=chunked_teacher)

    class OtherHead(type(draft)):
        def logits(self, hidden):
            return super().logits(hidden) * 2

    draft.__class__ = OtherHead
    with pytest.raises(ValueError, match="overrides logits"):
        ttt_loss(draft, **batch, loss_backend="chunked")


def test_auto_resolves_per_device():
    assert LOSS_BACKEND.resolve("auto", torch.device("cpu")) == "chunked" == default_loss_backend("cpu")
    assert default_loss_backend(torch.device("cuda", 0)) == "chunked"
    assert default_loss_backend("meta") == "plain"
    assert LOSS_BACKEND.choices == ("auto", "plain", "chunked")
    assert LOSS_BACKEND.resolve("plain", "cpu") == "plain"
