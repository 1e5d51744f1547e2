"""Teacher (§5): renormalised over the selected columns in lm_head order, OOV greedy token ⇒ unsupervised, and the
chunked teacher (final hidden + lm_head, chunk sizes that do not divide V) equals the full-logit teacher."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_eagle.training import compute_teacher, teacher_from_hidden, teacher_from_logits


def vocab(V=256, N=72, seed=0):
    selected = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:N]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    return selected, t2d


def test_renormalised_over_selected_columns():
    selected, t2d = vocab()
    logits = torch.randn(2, 9, 256)
    lm = torch.ones(2, 9, dtype=torch.long)
    teacher = teacher_from_logits(logits, selected, t2d, lm)
    torch.testing.assert_close(teacher.probs.sum(-1), torch.ones(2, 9))
    # exact: the same softmax over the same gathered columns (a gather copies values)
    torch.testing.assert_close(teacher.probs, torch.softmax(logits[..., selected], -1), rtol=0, atol=0)
    assert teacher.probs.dtype == torch.float32 and not teacher.probs.requires_grad
    assert torch.equal(teacher.top, logits.argmax(-1))


def test_out_of_vocabulary_greedy_token_is_not_supervised():
    selected, t2d = vocab()
    oov = int(torch.nonzero(~t2d)[0])
    logits = torch.randn(1, 6, 256)
    logits[0, 2, selected[5]] = 50.0  # in the draft vocabulary
    logits[0, 3, oov] = 50.0  # outside it
    lm = torch.tensor([[1, 1, 1, 1, 0, 1]])
    teacher = teacher_from_logits(logits, selected, t2d, lm)
    assert bool(teacher.pos[0, 2]) and not bool(teacher.pos[0, 3]) and not bool(teacher.pos[0, 4])
    assert torch.equal(teacher.pos, t2d[logits.argmax(-1)] & lm.bool())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_full(dtype):
    g = torch.Generator().manual_seed(3)
    selected, t2d = vocab()
    # Multiples of 1/16 in [-1/2, 1/2]: every product and partial sum is exact in fp32, so no GEMM tiling can change a
    # logit (bf16 still rounds ~20% of them) and the argmax comparisons below are exact on any CPU, ties included.
    hidden = (torch.randint(-8, 9, (2, 11, 128), generator=g) / 16).to(dtype)
    weight = (torch.randint(-8, 9, (256, 128), generator=g) / 16).to(dtype)
    lm = (torch.rand(2, 11, generator=g) > 0.3).long()
    full = teacher_from_logits(F.linear(hidden, weight), selected, t2d, lm)
    chunked = teacher_from_hidden(hidden, weight, selected, t2d, lm, vocab_chunk=37, seq_chunk=5)  # 37 ∤ 256
    assert torch.equal(chunked.top, full.top)
    assert torch.equal(chunked.pos, full.pos)
    torch.testing.assert_close(chunked.probs, full.probs, rtol=1e-5, atol=1e-6)  # softmax over other shapes


def test_chunked_argmax_keeps_the_first_index_across_chunks():
    selected, t2d = vocab()
    # Small integers: the dot products are exact in any summation order, so the tie survives every GEMM tiling.
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-1, 2, (256, 16), generator=g).float()
    hidden = torch.randint(1, 4, (1, 3, 16), generator=g).float()
    weight[40] = weight[200] = hidden[0, 1] * 10  # an exact tie at ids 40 and 200 (10·|h|² > |h|₁), in different chunks
    teacher = teacher_from_hidden(hidden, weight, selected, t2d, torch.ones(1, 3), vocab_chunk=64)
    assert int(teacher.top[0, 1]) == 40 == int(F.linear(hidden, weight).argmax(-1)[0, 1])


def test_compute_teacher_sources(make_draft):
    draft = make_draft()
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 7, 128, generator=g), torch.randn(256, 128, generator=g)
    lm = torch.ones(2, 7)
    a = compute_teacher(draft, lm, target_logits=F.linear(hidden, weight))
    b = compute_teacher(draft, lm, final_hidden=hidden, lm_head_weight=weight, vocab_chunk=100)
    # The argmax runs through other GEMM shapes in a and b: exact only because no row has a near tie.
    best = F.linear(hidden, weight).topk(2, -1).values
    assert (best[..., 0] - best[..., 1]).min() > 1e-3
    assert torch.equal(a.top, b.top) and torch.equal(a.pos, b.pos)
    torch.testing.assert_close(a.probs, torch.softmax(F.linear(hidden, weight)[..., draft.selected_token_ids], -1))
    with pytest.raises(ValueError, match="exactly one"):
        compute_teacher(draft, lm)
    with pytest.raises(ValueError, match="exactly one"):
        compute_teacher(draft, lm, target_logits=a.probs, final_hidden=hidden, lm_head_weight=weight)
    with pytest.raises(ValueError, match="lm_head_weight"):
        compute_teacher(draft, lm, final_hidden=hidden)
    with pytest.raises(ValueError, match="t2d"):
        teacher_from_logits(torch.randn(1, 2, 300), draft.selected_token_ids, draft.t2d, torch.ones(1, 2))
