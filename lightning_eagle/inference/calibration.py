"""Calibration of a draft's confidence head against the acceptance actually observed, per block position.

A head predicts, per drafted slot k (1-based here), ``c_k``: the chance that slot k is accepted. Confidence-scheduled
verification stops drafting (or verifying) where the predicted chance of getting that far falls below a threshold,
so what matters is whether those numbers mean what they say. Two readings of the same rounds are measured:

* ``cumulative`` (the primary one): the prediction ``∏_{i≤k} c_i`` against "slots 1..k all accepted" over every
  round — DeepSeek's DeepSpec evaluator (``deepspec/eval/dspark/confidence_head.py`` at commit ``afdfa7c``,
  ``ConfidenceHeadRecorder.observe``: ``sigmoid(confidence_logits).cumprod`` against the verifier's
  ``accept_prefix_mask``), the survival probability the DSpark paper's scheduler ranks and its Sequential
  Temperature Scaling calibrates position by position (`dspark.md`, "What it is");
* ``conditional``: ``c_k`` against "slot k accepted" over the rounds whose slots 1..k−1 were all accepted, the
  event the head's BCE target (the slot's analytic acceptance ``1 − ½‖p_d − p_t‖₁``) is the expectation of.

Observed acceptance is the verifier's: greedy, the draft token equals the target's argmax; at temperature > 0 the
rejection-sampling accept event of each slot. A round accepting ``a`` drafts accepted slots 1..a, so both readings
follow from ``(confidences, a)`` per round. DeepSpec also drops the slots after an accepted stop token; here, as
everywhere in the report, a round's ``a`` is kept as measured.

ECE as DeepSpec computes it: ``ECE_BINS`` equal-width bins on [0, 1] (bin ``⌊p·n⌋``, 1.0 in the last),
``Σ_b (n_b / N) |mean predicted_b − mean observed_b|``; beside it the Brier score ``mean (p − y)²``, the AUROC (how
well the prediction ranks accepted above rejected, what a threshold relies on; exact, from ranks with ties averaged,
where DeepSpec bins into 1000) and the reliability bins (count, mean predicted, mean observed) a plot draws.
``ece_mean`` weighs each position by its count (DeepSpec's ``summarize_confidence_row``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

ECE_BINS = 20  # DeepSpec's CONFIDENCE_NUM_BINS


def auroc(predicted: torch.Tensor, observed: torch.Tensor) -> float:
    """P(an accepted slot's prediction > a rejected one's), ties counting ½ (Mann-Whitney); nan without both."""
    positives = float(observed.sum())
    negatives = observed.numel() - positives
    if positives == 0 or negatives == 0:
        return math.nan
    _, group, counts = torch.unique(predicted, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = (ends - (counts.double() - 1) / 2)[group]  # 1-based ranks, tied values sharing their mean rank
    return float(((ranks * observed).sum() - positives * (positives + 1) / 2) / (positives * negatives))


def reliability(predicted, observed, bins: int = ECE_BINS) -> dict[str, Any]:
    """ECE, Brier score, AUROC, means and the filled reliability bins of ``predicted`` probabilities against
    ``observed`` 0/1 outcomes (same length; nan and no bins when empty)."""
    p = torch.as_tensor(predicted, dtype=torch.float64).reshape(-1)
    y = torch.as_tensor(observed, dtype=torch.float64).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"predicted {tuple(p.shape)} and observed {tuple(y.shape)} must have the same length")
    n = p.numel()
    if n == 0:
        nan = math.nan
        return {"count": 0, "ece": nan, "brier": nan, "auroc": nan, "mean_predicted": nan, "mean_observed": nan,
                "reliability": []}  # fmt: skip
    index = (p * bins).long().clamp(0, bins - 1)
    count = torch.bincount(index, minlength=bins)
    pred_sum, obs_sum = torch.bincount(index, p, minlength=bins), torch.bincount(index, y, minlength=bins)
    table = [
        {"low": b / bins, "high": (b + 1) / bins, "count": int(count[b]),
         "mean_predicted": float(pred_sum[b] / count[b]), "mean_observed": float(obs_sum[b] / count[b])}
        for b in range(bins) if count[b] > 0
    ]  # fmt: skip
    return {
        "count": n,
        "ece": float((pred_sum - obs_sum).abs().sum() / n),  # Σ_b n_b/N |mean_p − mean_y| = Σ_b |Σp − Σy| / N
        "brier": float(((p - y) ** 2).mean()),
        "auroc": auroc(p, y),
        "mean_predicted": float(p.mean()),
        "mean_observed": float(y.mean()),
        "reliability": table,
    }


def _reading(entries: list[dict[str, Any]]) -> dict[str, Any]:
    total = sum(e["count"] for e in entries)
    mean = sum(e["ece"] * e["count"] for e in entries if e["count"]) / total if total else math.nan
    return {"ece_per_position": [e["ece"] for e in entries], "ece_mean": mean, "positions": entries}


def position_calibration(
    confidence_per_round: list[list[float]], accepted_per_round: list[int], bins: int = ECE_BINS
) -> dict[str, Any] | None:
    """Both readings (module docstring) per block position of rounds that each drafted K slots, from each round's
    ``K`` confidences and accepted count; None when no confidence was recorded. Position j of the lists is slot
    j + 1 (each entry also says its ``position``, 1-based)."""
    if not confidence_per_round:
        return None
    if len(confidence_per_round) != len(accepted_per_round):
        raise ValueError(
            f"{len(confidence_per_round)} rounds of confidences for {len(accepted_per_round)} verification rounds"
        )
    c = torch.tensor(confidence_per_round, dtype=torch.float64)  # [R, K]: every round drafts K
    slot = torch.arange(c.shape[1])
    a = torch.tensor(accepted_per_round)[:, None]
    accepted, reached = a > slot, a >= slot  # slot k+1 accepted (so 1..k+1); slots 1..k accepted
    cumulative = c.cumprod(dim=1)
    readings = {"cumulative": [], "conditional": []}
    for k in range(c.shape[1]):
        here = reached[:, k]
        for name, entry in (
            ("cumulative", reliability(cumulative[:, k], accepted[:, k], bins)),
            ("conditional", reliability(c[here, k], accepted[here, k], bins)),
        ):
            readings[name].append({"position": k + 1, **entry})
    return {"bins": bins, **{name: _reading(entries) for name, entries in readings.items()}}
