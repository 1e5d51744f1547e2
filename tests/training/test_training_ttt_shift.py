"""Shift semantics and the §2 alignment table, checked through the real unroll on a hand-built sequence."""

from __future__ import annotations

import pytest
import torch

from lightning_eagle.training import shift_left, shift_target_outputs, ttt_loss
from lightning_eagle.training.ttt import draft_step


def test_shift_left_zero_fills():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x).tolist() == [[2, 3, 4, 0]]
    assert shift_left(x, 2).tolist() == [[3, 4, 0, 0]]
    assert shift_left(x, 9).tolist() == [[0, 0, 0, 0]]
    assert shift_left(x, 0) is x
    assert shift_left(torch.tensor([[True, False, True]])).tolist() == [[False, True, False]]
    logits = torch.arange(24.0).view(1, 4, 6)
    assert torch.equal(shift_left(logits)[0, :3], logits[0, 1:]) and not shift_left(logits)[0, 3].any()
    with pytest.raises(ValueError):
        shift_left(x, -1)


def test_one_token_shift_moves_ids_mask_and_target_outputs_only():
    ids, lm, hid = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 1]]), torch.arange(6.0).view(1, 3, 2)
    s_ids, s_lm, s_hid = shift_target_outputs(ids, lm, hid)
    assert s_ids.tolist() == [[6, 7, 0]] and s_lm.tolist() == [[1, 1, 0]]
    assert s_hid.tolist() == [[[2.0, 3.0], [4.0, 5.0], [0.0, 0.0]]]


def test_alignment_table(make_draft):
    """Slot t at step k: input token x_{t+k+1}; teacher = target distribution at position t+1+k (its greedy token is
    x_{t+k+2}); gate = loss_mask[t+1+k]."""
    draft = make_draft()
    T = 12
    x = torch.arange(100, 100 + T)[None]  # x_q = 100 + q
    others = [i for i in range(256) if not 100 <= i < 100 + T + 2][: 72 - T - 2]
    draft.set_vocab_mapping(torch.tensor(sorted(others + list(range(100, 100 + T + 2)))))
    lm = torch.zeros(1, T, dtype=torch.long)
    lm[0, 3:9] = 1
    logits = torch.zeros(1, T, 256)
    logits[0, torch.arange(T), x[0] + 1] = 10.0  # the target at position q predicts x_{q+1}
    ids, loss_mask, target_logits = shift_target_outputs(x, lm, logits)

    seen_ids, seen_teacher = [], []

    def record_step(d, step_ids, hidden, attention_mask, cache):
        seen_ids.append(step_ids.clone())
        return draft_step(d, step_ids, hidden, attention_mask, cache)

    def record_loss(step_logits, probs, pos):
        seen_teacher.append((draft.selected_token_ids[probs.argmax(-1)], pos.clone()))
        return step_logits.float().sum() * 0

    aux = torch.randn(1, T, 384)
    ttt_loss(draft, ids, torch.ones(1, T), loss_mask, aux, target_logits, ttt_steps=3,
             draft_step_fn=record_step, step_loss_fn=record_loss)  # fmt: skip
    for k in range(3):
        for t in range(T - k - 2):
            assert int(seen_ids[k][0, t]) == int(x[0, t + k + 1]), (k, t)
            token, pos = seen_teacher[k]
            assert int(token[0, t]) == int(x[0, t + k + 2]), (k, t)
            assert bool(pos[0, t]) == bool(lm[0, t + 1 + k]), (k, t)
        assert not seen_ids[k][0, T - k :].any()  # the shifted-in tail is zero-filled
