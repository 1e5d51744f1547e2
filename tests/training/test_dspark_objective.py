"""The DSpark anchored-block objective: anchors (candidate rule, sorting, padding, uniformity, determinism), blocks
(labels, teacher-forced Markov inputs, positions, the cumulative valid mask) on hand-built rows checked against the
rule written out here, the loss against an independent per-row computation, the chunked twin against the plain one
(value and every gradient, chunk sizes that do and do not divide N, bf16), the chunked peak of ``[*,V]`` tensors,
the global normalisation over two simulated ranks, the teacher side without gradient, and the metrics."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.training.dspark_anchors import anchor_candidates, anchor_generator, block_targets, sample_anchors
from lightning_eagle.training.dspark_metrics import DSparkMetrics, dspark_block_stats
from lightning_eagle.training.dspark_objective import (
    DSparkCoefficients,
    DSparkHeads,
    DSparkRows,
    dspark_loss_chunked,
    dspark_loss_plain,
    global_slot_weight,
    slot_weights,
    supervised_rows,
)

V, H, HT, R, G = 97, 16, 12, 8, 5  # V differs from every other width, so a [*, V] tensor is recognisable


def _mask(B, T, seed, p=0.75):
    return torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < p


# ---- anchors -------------------------------------------------------------------------------------------------


def test_anchors_follow_the_candidate_rule_sorted_and_padded():
    loss_mask = _mask(6, 40, seed=1)
    loss_mask[4] = False  # a row without candidates
    loss_mask[5] = False
    loss_mask[5, 10:13] = True  # exactly two candidates: 10 and 11
    anchors, keep = sample_anchors(loss_mask, 9, anchor_generator(0, 0, 0))
    assert anchors.shape == keep.shape == (6, 9) and anchors.dtype == torch.long and keep.dtype == torch.bool
    for b in range(6):
        candidates = [p for p in range(39) if loss_mask[b, p] and loss_mask[b, p + 1]]
        n = min(9, len(candidates))
        assert keep[b].tolist() == [True] * n + [False] * (9 - n)  # kept first, padding after
        picked = anchors[b, :n].tolist()
        assert all(p in candidates for p in picked)
        assert picked == sorted(set(picked))  # strictly increasing: sorted, without replacement
        assert anchors[b, n:].tolist() == [0] * (9 - n)
    assert anchors[5, :2].tolist() == [10, 11]
    assert torch.equal(anchor_candidates(loss_mask)[5].nonzero().squeeze(1), torch.tensor([10, 11]))


def test_more_anchors_than_positions_and_bad_arguments():
    loss_mask = torch.ones(2, 4, dtype=torch.bool)
    anchors, keep = sample_anchors(loss_mask, 10, anchor_generator(1, 2, 3))
    assert keep.shape == (2, 4)  # a row of 4 positions holds at most 4 anchors: no padding beyond (the plan's A)
    assert keep.sum(1).tolist() == [3, 3] and anchors[:, :3].tolist() == [[0, 1, 2]] * 2
    with pytest.raises(ValueError, match="num_anchors must be an int >= 1"):
        sample_anchors(loss_mask, 0, anchor_generator(0, 0, 0))
    with pytest.raises(ValueError, match=r"loss_mask must be \[B,T\]"):
        sample_anchors(loss_mask[0], 2, anchor_generator(0, 0, 0))
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        anchor_generator(0, 0, -1)


def test_anchors_are_uniform_without_replacement():
    loss_mask = torch.zeros(1, 30, dtype=torch.bool)
    loss_mask[0, 5:16] = True  # candidates 5..14
    counts = torch.zeros(30)
    draws = 3000
    for step in range(draws):
        anchors, keep = sample_anchors(loss_mask, 3, anchor_generator(7, step, 0))
        assert bool(keep.all())
        counts[anchors[0]] += 1
    frequency = counts[5:15] / draws  # each candidate: 3 of 10 -> 0.3 (std about 0.008 at 3000 draws)
    assert torch.allclose(frequency, torch.full((10,), 0.3), atol=0.04), frequency
    assert counts[:5].sum() == 0 and counts[15:].sum() == 0


def test_anchors_are_a_function_of_seed_step_and_rank():
    loss_mask = _mask(3, 64, seed=2)

    def draw(seed, step, rank):
        return sample_anchors(loss_mask, 8, anchor_generator(seed, step, rank))[0]

    assert torch.equal(draw(0, 5, 1), draw(0, 5, 1))
    others = [draw(1, 5, 1), draw(0, 6, 1), draw(0, 5, 0)]
    assert all(not torch.equal(draw(0, 5, 1), other) for other in others)


# ---- blocks --------------------------------------------------------------------------------------------------


def test_block_targets_follow_the_rule_on_hand_built_rows():
    T = 12
    input_ids = torch.arange(100, 100 + 2 * T).view(2, T)
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0]]).bool()
    anchors = torch.tensor([[1, 5, 9, 0], [3, 8, 0, 0]])  # 9 + 3 runs past the row; row 1 has a padded anchor
    keep = torch.tensor([[True, True, True, False], [True, True, False, False]])
    blocks = block_targets(input_ids, loss_mask, anchors, keep, G)
    for b in range(2):
        for a in range(4):
            p = int(anchors[b, a])
            chain = True
            for k in range(G):
                q = p + k + 1
                inside = q < T
                label = int(input_ids[b, q]) if inside else 0
                chain = chain and inside and bool(loss_mask[b, q])
                assert int(blocks.labels[b, a, k]) == label
                assert int(blocks.positions[b, a, k]) == p + k
                assert bool(blocks.valid[b, a, k]) == (chain and bool(keep[b, a]))
                previous = int(input_ids[b, p]) if k == 0 else int(blocks.labels[b, a, k - 1])
                assert int(blocks.prev_tokens[b, a, k]) == previous
    # anchor 1 of row 0 (p=1): labels at 2, 3 supervised, 4 not -> slots 0, 1 only, even though 5.. are supervised
    assert blocks.valid[0, 0].tolist() == [True, True, False, False, False]
    rows, slots = blocks.flat_rows()
    expected = [(b * T + p + k, k) for b in range(2) for a, p in enumerate(anchors[b].tolist()) for k in range(G)]
    expected = [e for e, v in zip(expected, blocks.valid.reshape(-1).tolist()) if v]
    assert list(zip(rows.tolist(), slots.tolist())) == expected


def test_block_targets_refuse_bad_input():
    ids, lm = torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.bool)
    anchors, keep = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        block_targets(ids, lm, anchors, keep, 0)
    with pytest.raises(ValueError, match="anchors and keep must both be"):
        block_targets(ids, lm, anchors[:1], keep[:1], 3)
    with pytest.raises(ValueError, match="kept anchor lies outside the row"):
        block_targets(ids, lm, anchors + 6, keep, 3)


# ---- the loss ------------------------------------------------------------------------------------------------


def _rows_and_heads(N, seed, dtype=torch.float32, bias=True, block_size=G):
    g = torch.Generator().manual_seed(seed)
    rows = DSparkRows(
        hidden=torch.randn(N, H, generator=g).to(dtype).requires_grad_(),
        prev_tokens=torch.randint(0, V, (N,), generator=g),
        labels=torch.randint(0, V, (N,), generator=g),
        slots=torch.randint(0, block_size, (N,), generator=g),
        teacher_hidden=torch.randn(N, HT, generator=g).to(dtype),
        block_size=block_size,
    )
    heads = DSparkHeads(
        lm_head_weight=(torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_(),
        markov_w1=(torch.randn(V, R, generator=g) * 0.5).to(dtype).requires_grad_(),
        markov_w2=(torch.randn(V, R, generator=g) * 0.5).to(dtype).requires_grad_(),
        confidence_weight=(torch.randn(1, H + R, generator=g) * 0.3).requires_grad_(),
        confidence_bias=torch.randn(1, generator=g).requires_grad_() if bias else None,
        teacher_head_weight=(torch.randn(V, HT, generator=g) * 0.5).to(dtype),
    )
    return rows, heads


def _subset(rows, part):
    """The rows ``part`` of ``rows``, with a hidden leaf of their own (a rank holding them)."""
    return DSparkRows(
        hidden=rows.hidden.detach()[part].clone().requires_grad_(),
        prev_tokens=rows.prev_tokens[part],
        labels=rows.labels[part],
        slots=rows.slots[part],
        teacher_hidden=rows.teacher_hidden[part],
        block_size=rows.block_size,
    )


def _leaves(rows, heads):
    named = {"hidden": rows.hidden, **{n: getattr(heads, n) for n in ("lm_head_weight", "markov_w1", "markov_w2")}}
    named["confidence_weight"] = heads.confidence_weight
    if heads.confidence_bias is not None:
        named["confidence_bias"] = heads.confidence_bias
    return named


def _grads(loss, rows, heads):
    named = _leaves(rows, heads)
    return dict(zip(named, torch.autograd.grad(loss, list(named.values()))))


def _independent_loss(rows, heads, c: DSparkCoefficients):
    """The objective written row by row from its definition, with exp/log sums instead of torch's softmax ops."""
    total, weight_sum = 0.0, 0.0
    for i in range(rows.hidden.shape[0]):
        m = heads.markov_w1[rows.prev_tokens[i]]
        z = heads.lm_head_weight @ rows.hidden[i] + heads.markov_w2 @ m
        p_d = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
        with torch.no_grad():
            u = heads.teacher_head_weight @ rows.teacher_hidden[i]
            p_t = torch.exp(u - u.max()) / torch.exp(u - u.max()).sum()
        ce = torch.log(torch.exp(z - z.max()).sum()) + z.max() - z[rows.labels[i]]
        l1 = (p_d - p_t).abs().sum()
        y = (1 - 0.5 * l1).detach()
        x = heads.confidence_weight[0] @ torch.cat([rows.hidden[i], m])
        if heads.confidence_bias is not None:
            x = x + heads.confidence_bias[0]
        bce = torch.clamp(x, min=0) - x * y + torch.log1p(torch.exp(-x.abs()))
        w = math.exp(-int(rows.slots[i]) / c.slot_decay)
        total = total + w * (c.ce * ce + c.l1 * l1 + c.confidence * bce)
        weight_sum += w
    return total / weight_sum


@pytest.mark.parametrize("bias", [True, False])
def test_both_twins_equal_an_independent_computation(bias):
    rows, heads = _rows_and_heads(13, seed=3, bias=bias)
    coefficients = DSparkCoefficients(ce=0.3, l1=0.6, confidence=0.8, slot_decay=2.5)
    reference = _independent_loss(rows, heads, coefficients)
    want = _grads(reference, rows, heads)
    for out in (
        dspark_loss_plain(rows, heads, coefficients=coefficients),
        dspark_loss_chunked(rows, heads, coefficients=coefficients, chunk=4),
    ):
        torch.testing.assert_close(out.loss, reference.float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.ce * 0.3 + out.l1 * 0.6 + out.confidence * 0.8, out.loss.detach())
        for name, grad in _grads(out.loss, rows, heads).items():
            torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("N,chunk", [(30, 1), (30, 6), (30, 7), (30, 64), (1, 3)])
def test_chunked_equals_plain_in_value_and_gradients(N, chunk):
    rows, heads = _rows_and_heads(N, seed=N + chunk)
    plain = dspark_loss_plain(rows, heads)
    chunked = dspark_loss_chunked(rows, heads, chunk=chunk)
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=1e-6, atol=1e-6)
    for field in ("ce", "l1", "confidence", "tv", "confidence_logit", "weights"):
        torch.testing.assert_close(getattr(chunked, field), getattr(plain, field), rtol=1e-5, atol=1e-6, msg=field)
    want = _grads(plain.loss, rows, heads)
    for name, grad in _grads(chunked.loss, rows, heads).items():
        assert grad.abs().sum() > 0, name  # every input takes part
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_equals_plain_in_bf16():
    rows, heads = _rows_and_heads(21, seed=5, dtype=torch.bfloat16)
    plain = dspark_loss_plain(rows, heads)
    chunked = dspark_loss_chunked(rows, heads, chunk=8)
    assert chunked.loss.dtype == torch.float32
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=1e-4, atol=1e-5)
    want = _grads(plain.loss, rows, heads)
    for name, grad in _grads(chunked.loss, rows, heads).items():
        assert grad.dtype == want[name].dtype, name
        torch.testing.assert_close(grad.float(), want[name].float(), rtol=2e-2, atol=2e-3, msg=name)


class VocabRows(TorchDispatchMode):
    """While active: the most rows of any new tensor whose last dim is V (logits, probabilities, their gradient; not
    views, such as the ``[H,V]`` transpose of a weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == V:
                self.rows = max(self.rows, t.numel() // V)
        return out


def test_chunked_keeps_at_most_chunk_rows_of_vocab_width():
    rows, heads = _rows_and_heads(40, seed=6)
    saved = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == V:
            saved.append(tuple(t.shape))
        return t

    for fn, bound in ((dspark_loss_plain, 40), (lambda r, h: dspark_loss_chunked(r, h, chunk=6), 6)):
        saved.clear()
        probe = VocabRows()
        with probe, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(rows, heads)
            out.loss.backward()
        assert probe.rows == bound  # the plain twin reaches N rows: the probe sees them
        if fn is dspark_loss_plain:
            assert saved
        else:
            assert saved == []  # nothing of vocabulary width is kept for the backward


def test_two_ranks_with_the_global_weight_equal_one_rank_holding_both():
    rows, heads = _rows_and_heads(17, seed=7)
    whole = dspark_loss_chunked(rows, heads, chunk=5)
    want = _grads(whole.loss, rows, heads)
    parts = [slice(0, 6), slice(6, 17)]
    slot_sums = [slot_weights(rows.slots[s], G, 4.0).sum() for s in parts]
    normalizer = global_slot_weight(sum(slot_sums))  # what the all-reduce over the two ranks gives
    losses, grads = [], []
    for s in parts:
        rank_rows = _subset(rows, s)
        out = dspark_loss_chunked(rank_rows, heads, normalizer=normalizer, world_size=2, chunk=5)
        losses.append(out.loss.detach())
        grads.append(_grads(out.loss, rank_rows, heads))
    torch.testing.assert_close((losses[0] + losses[1]) / 2, whole.loss.detach())  # DDP logs the mean
    for name in want:  # DDP averages the ranks' gradients
        if name == "hidden":  # each rank holds its own rows of h
            torch.testing.assert_close(torch.cat([g["hidden"] for g in grads]) / 2, want["hidden"])
        else:
            torch.testing.assert_close((grads[0][name] + grads[1][name]) / 2, want[name], msg=name)
    # a rank normalising by its own weight alone trains on another loss (the rule is not vacuous here)
    alone = dspark_loss_chunked(_subset(rows, parts[0]), heads)
    assert not torch.allclose(alone.loss.detach(), losses[0] / 2)


def _gloo_rank(rank, world, rows, heads, parts):
    mine = _subset(rows, parts[rank])
    normalizer = global_slot_weight(slot_weights(mine.slots, G, 4.0).sum())  # the real all-reduce
    out = dspark_loss_chunked(mine, heads, normalizer=normalizer, world_size=world, chunk=4)
    return {"loss": out.loss.detach(), "normalizer": normalizer, "grads": _grads(out.loss, mine, heads)}


@pytest.mark.multiprocess
def test_two_gloo_ranks_all_reduce_the_weight_and_average_to_one_process():
    rows, heads = _rows_and_heads(15, seed=16)
    parts = [slice(0, 9), slice(9, 15)]
    ranks = launch_local(_gloo_rank, 2, rows, heads, parts)
    whole = dspark_loss_plain(rows, heads)
    want = _grads(whole.loss, rows, heads)
    torch.testing.assert_close(ranks[0]["normalizer"], whole.weights.sum())
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, whole.loss.detach())
    torch.testing.assert_close(torch.cat([r["grads"]["hidden"] for r in ranks]) / 2, want["hidden"])
    for name in ("lm_head_weight", "markov_w1", "markov_w2", "confidence_weight", "confidence_bias"):
        torch.testing.assert_close((ranks[0]["grads"][name] + ranks[1]["grads"][name]) / 2, want[name], msg=name)


def test_the_teacher_side_gets_no_gradient():
    rows, heads = _rows_and_heads(9, seed=8)
    rows.teacher_hidden.requires_grad_()
    heads.teacher_head_weight.requires_grad_()
    for fn in (dspark_loss_plain, dspark_loss_chunked):
        out = fn(rows, heads)
        assert out.tv.requires_grad is False and out.confidence_logit.requires_grad is False
        out.loss.backward()
        assert rows.teacher_hidden.grad is None and heads.teacher_head_weight.grad is None
        # the stop-gradient of the confidence target: the BCE term moves only the confidence head's inputs
        only_bce = fn(rows, heads, coefficients=DSparkCoefficients(ce=0.0, l1=0.0, confidence=1.0))
        grads = _grads(only_bce.loss, rows, heads)
        assert grads["lm_head_weight"].abs().max() == 0 and grads["markov_w2"].abs().max() == 0
        assert grads["hidden"].abs().max() > 0 and grads["confidence_weight"].abs().max() > 0


def test_bad_shapes_and_settings_are_named():
    rows, heads = _rows_and_heads(4, seed=9)
    heads.markov_w2 = heads.markov_w2[:, :3]
    with pytest.raises(ValueError, match=r"markov_w2 \(97, 3\) \(expected \(97, 8\)\)"):
        dspark_loss_plain(rows, heads)
    rows, heads = _rows_and_heads(4, seed=9)
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        dspark_loss_chunked(rows, heads, chunk=0)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        dspark_loss_plain(rows, heads, world_size=0)
    with pytest.raises(ValueError, match="DSparkCoefficients.slot_decay must be a finite number > 0"):
        DSparkCoefficients(slot_decay=0.0)
    with pytest.raises(ValueError, match="DSparkCoefficients.l1 must be a finite number >= 0"):
        DSparkCoefficients(l1=float("nan"))


# ---- metrics -------------------------------------------------------------------------------------------------


def test_metrics_follow_their_definitions():
    loss_mask = _mask(3, 30, seed=10, p=0.8)
    ids = torch.randint(0, V, (3, 30), generator=torch.Generator().manual_seed(10))
    anchors, keep = sample_anchors(loss_mask, 6, anchor_generator(0, 1, 0))
    blocks = block_targets(ids, loss_mask, anchors, keep, G)
    g = torch.Generator().manual_seed(11)
    block_hidden, final_hidden = torch.randn(3, 6, G, H, generator=g), torch.randn(3, 30, HT, generator=g)
    rows = supervised_rows(blocks, block_hidden, final_hidden)
    slots = rows.slots
    supervised = [(b, a, k) for b in range(3) for a in range(6) for k in range(G) if blocks.valid[b, a, k]]
    assert slots.tolist() == [k for _, _, k in supervised]
    for i, (b, a, k) in enumerate(supervised):  # the gather, written out
        assert torch.equal(rows.hidden[i], block_hidden[b, a, k])
        assert torch.equal(rows.teacher_hidden[i], final_hidden[b, int(anchors[b, a]) + k])
        assert rows.labels[i] == blocks.labels[b, a, k] and rows.prev_tokens[i] == blocks.prev_tokens[b, a, k]
    _, heads = _rows_and_heads(1, seed=12)
    out = dspark_loss_plain(rows, heads)
    stats = dspark_block_stats(blocks.valid, keep, out)
    metric = DSparkMetrics(G)
    metric.update(stats)
    result = metric.compute()
    accept = (1 - out.tv).tolist()
    by_slot = {k: [a for a, s in zip(accept, slots.tolist()) if s == k] for k in range(G)}
    for k in range(G):
        assert result[f"accept_{k}"].item() == pytest.approx(sum(by_slot[k]) / max(1, len(by_slot[k])), rel=1e-6)
    taus, i = [], 0
    for b in range(3):
        for a in range(6):
            n = int(blocks.valid[b, a].sum())
            if keep[b, a]:
                taus.append(1 + sum(math.prod(accept[i : i + j + 1]) for j in range(n)))
            i += n
    assert result["tau_sim"].item() == pytest.approx(sum(taus) / len(taus), rel=1e-6)
    conf = torch.sigmoid(out.confidence_logit).tolist()
    w = [math.exp(-s / 4.0) for s in slots.tolist()]
    errors = [c - a for c, a in zip(conf, accept)]
    assert result["confidence_bias"].item() == pytest.approx(sum(x * y for x, y in zip(w, errors)) / sum(w), rel=1e-5)
    assert result["confidence_abs_error"].item() == pytest.approx(
        sum(x * abs(y) for x, y in zip(w, errors)) / sum(w), rel=1e-5
    )
    assert result["anchors_per_row"].item() == pytest.approx(keep.sum().item() / 3)
    # two batches accumulate as their sums
    metric.update(stats)
    again = metric.compute()
    for name, value in result.items():
        torch.testing.assert_close(again[name], value, msg=name)
    with pytest.raises(ValueError, match="valid marks"):
        dspark_block_stats(blocks.valid[:, :, :2], keep, out)


def test_without_a_confidence_head_and_without_its_markov_input():
    rows, heads = _rows_and_heads(11, seed=13)
    full = dspark_loss_plain(rows, heads)
    heads.confidence_weight = None
    for fn in (dspark_loss_plain, lambda r, h: dspark_loss_chunked(r, h, chunk=4)):
        out = fn(rows, heads)
        assert out.confidence_logit is None and out.confidence.item() == 0
        torch.testing.assert_close(out.loss, full.loss.detach() - full.confidence)  # the other terms unchanged
    valid = torch.ones(1, 11, 1, dtype=torch.bool)
    stats = dspark_block_stats(valid, torch.ones(1, 11, dtype=torch.bool), out)
    metric = DSparkMetrics(1)
    metric.update(stats)
    assert "confidence_bias" not in metric.compute() and "tau_sim" in metric.compute()
    rows, heads = _rows_and_heads(11, seed=14)
    heads.confidence_with_markov = False
    with pytest.raises(ValueError, match=r"confidence_weight \(1, 24\) \(expected \(1, 16\)\)"):
        dspark_loss_plain(rows, heads)
    heads.confidence_weight = heads.confidence_weight.detach()[:, :H].clone().requires_grad_()
    plain, chunked = dspark_loss_plain(rows, heads), dspark_loss_chunked(rows, heads, chunk=3)
    torch.testing.assert_close(chunked.loss, plain.loss)
    want = _grads(plain.loss, rows, heads)
    for name, grad in _grads(chunked.loss, rows, heads).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_equals_plain_under_autocast():
    """Lightning's bf16-mixed precision: fp32 weights, bf16 matmuls; the chunked backward reruns under the same
    autocast state as its forward."""
    rows, heads = _rows_and_heads(19, seed=15)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = dspark_loss_plain(rows, heads)
        chunked = dspark_loss_chunked(rows, heads, chunk=5)
    want = _grads(plain.loss, rows, heads)
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=1e-4, atol=1e-5)
    for name, grad in _grads(chunked.loss, rows, heads).items():
        assert grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, want[name], rtol=2e-2, atol=2e-3, msg=name)
