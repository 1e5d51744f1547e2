"""Metrics (§7): per-step accuracy, the prefix-hit chain with an out-of-vocabulary break, τ_sim on a hand-computed
example driven through the real unroll, and cross-rank reduction of counts (sums, never averaged ratios)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_eagle.training import TTTMetrics, tau_sim, ttt_loss

# Hand-built case: T=5, K=3, target vocabulary 0..5, draft vocabulary = {0,1,2,3} (4 and 5 are out of vocabulary).
TOP = [1, 2, 5, 3, 0]  # the target's greedy token per (post-shift) row; row 2 is OOV
LOSS_MASK = [1, 1, 1, 1, 0]
PREDS = [[1, 2, 0, 3, 0], [2, 2, 3, 1, 0], [0, 1, 0, 0, 0]]  # the draft's greedy id per step and slot


class FakeDraft:
    """Duck-typed draft whose step-k logits put their maximum on ``PREDS[k]``."""

    config = SimpleNamespace()
    selected_token_ids = torch.arange(4)
    t2d = torch.tensor([True, True, True, True, False, False])

    def project(self, aux):
        return aux

    def logits(self, hidden):
        return hidden


def fake_step(draft, ids, hidden, attention_mask, cache):
    k = len(cache)
    cache.append(torch.zeros(1), torch.zeros(1))
    return torch.nn.functional.one_hot(torch.tensor([PREDS[k]]), 4).float() * 5


def hand_case():
    target_logits = torch.nn.functional.one_hot(torch.tensor([TOP]), 6).float() * 8
    ids = torch.zeros(1, 5, dtype=torch.long)
    return ttt_loss(FakeDraft(), ids, torch.ones(1, 5), torch.tensor([LOSS_MASK]), torch.zeros(1, 5, 4),
                    target_logits, ttt_steps=3, step_decay=0.8, draft_step_fn=fake_step)  # fmt: skip


def test_hand_computed_counts_and_tau():
    out = hand_case()
    # step 0: slots 0,1,3 correct & supervised (row 2 OOV, row 4 unmasked)
    # step 1: slot t vs row t+1 → slots 0 (2==2) and 2 (3==3); slot 1 meets the OOV row 2: a break, still valid
    # step 2: slot 1 predicts 1 but row 3 wants 3; rows 2 and 4 are unsupervised
    assert out.per_step_correct.tolist() == [3, 2, 0]
    assert out.per_step_valid.tolist() == [3, 2, 1]
    assert out.step_prefix_hits.tolist() == [3, 1, 0]
    assert out.step_valid.tolist() == [4, 3, 2]  # gates AND-ed along the chain; the OOV slot stays in
    assert float(out.tau_sim) == pytest.approx(1 + 3 / 4 + 1 / 3 + 0 / 2)
    assert out.per_step_accuracy.tolist() == [1.0, 1.0, 0.0]


def test_metric_accumulates_counts():
    metric = TTTMetrics(ttt_steps=3)
    out = hand_case()
    metric.update(out)
    metric.update(out)
    result = metric.compute()
    assert set(result) == {"acc_0", "acc_1", "acc_2", "accuracy", "tau_sim"}
    assert float(result["accuracy"]) == pytest.approx(5 / 6)
    assert float(result["tau_sim"]) == pytest.approx(1 + 3 / 4 + 1 / 3)
    with pytest.raises(ValueError, match="shape"):
        TTTMetrics(ttt_steps=7).update(out)


def test_cross_rank_reduction_sums_counts():
    """Two 'ranks' with different amounts of data: merging states (the same dist_reduce_fx DDP sync uses) sums counts;
    the merged τ_sim is the ratio of sums, not the mean of per-rank τ_sim."""
    a = SimpleNamespace(
        per_step_correct=torch.tensor([9, 4]),
        per_step_valid=torch.tensor([10, 10]),
        step_prefix_hits=torch.tensor([9, 3]),
        step_valid=torch.tensor([10, 9]),
    )
    b = SimpleNamespace(per_step_correct=torch.tensor([0, 0]), per_step_valid=torch.tensor([1, 1]),
                        step_prefix_hits=torch.tensor([0, 0]), step_valid=torch.tensor([1, 1]))  # fmt: skip
    rank0, rank1, single = TTTMetrics(2), TTTMetrics(2), TTTMetrics(2)
    rank0.update(a)
    rank1.update(b)
    single.update(a)
    single.update(b)
    assert all(getattr(fx, "__name__", "") == "dim_zero_sum" for fx in rank0._reductions.values())
    rank0.merge_state(rank1)
    merged, expected = rank0.compute(), single.compute()
    for key in expected:  # exact: the same integer counts through the same compute
        assert torch.equal(merged[key], expected[key]), key
    assert float(merged["tau_sim"]) == pytest.approx(1 + 9 / 11 + 3 / 10)
    mean_of_ranks = (
        float(tau_sim(a.step_prefix_hits, a.step_valid)) + float(tau_sim(b.step_prefix_hits, b.step_valid))
    ) / 2
    assert abs(mean_of_ranks - float(merged["tau_sim"])) > 0.3
