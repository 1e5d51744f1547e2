"""Acceptance metrics of the DSpark objective (DeepSpec's ``accept_rate@k``, ``tau_probabilistic``, confidence
errors), as :mod:`~lightning_eagle.training.metrics` does for EAGLE-3: per batch, sums and counts
(:func:`dspark_block_stats`); across batches and ranks, a torchmetrics ``Metric`` of those sums
(:class:`DSparkMetrics`) whose ratios are formed only in ``compute``.

With ``a_i = 1 − TV_i`` the analytic acceptance probability of a supervised slot (TV between draft and teacher):

* ``accept_k = Σ_{slot k supervised} a / #(slot k supervised)``;
* ``tau_sim = mean over blocks of 1 + Σ_k Π_{i≤k} a_i`` (an unsupervised slot ends its block's product: the
  reference's rule; the blocks are the kept anchors, each with slot 0 supervised), the formula of evaluation's
  ``tau_analytic`` (:func:`~lightning_eagle.inference.sampling.expected_tokens_per_round`);
* ``confidence_abs_error`` / ``confidence_bias``: ``σ(c) − a``, absolute / signed, weighted by the slot weights
  (the reference's weighting; absent without a confidence head);
* ``anchors_per_row``: kept anchors per batch row.

Usage in a LightningModule: create in ``__init__``, ``metric.update(dspark_block_stats(blocks.valid, keep, out))``,
then ``self.log_dict({f"val/{k}": v for k, v in metric.compute().items()})`` and ``metric.reset()``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torchmetrics import Metric

from lightning_eagle.inference.sampling import expected_tokens_per_round


@dataclass
class DSparkStats:
    """One batch's sums (fp64) and counts (int64); every field adds up over batches and ranks."""

    accept_sum: torch.Tensor  # [g] Σ a at slot k
    accept_count: torch.Tensor  # [g] supervised slots k
    tau_sum: torch.Tensor  # Σ over blocks of 1 + Σ_k Π_{i≤k} a_i
    blocks: torch.Tensor  # blocks with a supervised slot
    confidence_abs_sum: torch.Tensor  # Σ w |σ(c) − a|
    confidence_bias_sum: torch.Tensor  # Σ w (σ(c) − a)
    confidence_weight: torch.Tensor  # Σ w
    anchors: torch.Tensor  # kept anchors
    rows: torch.Tensor  # batch rows


@torch.no_grad()
def dspark_block_stats(valid: torch.Tensor, keep: torch.Tensor, loss) -> DSparkStats:
    """The :class:`DSparkStats` of a batch: ``valid [B,A,g]`` / ``keep [B,A]`` (``DSparkBlocks.valid``, the
    anchors' ``keep``) and ``loss``, the :class:`~lightning_eagle.training.dspark_objective.DSparkLoss` of its
    ``valid`` slots in ``DSparkBlocks.flat_rows`` order (its ``tv``, ``confidence_logit``, ``weights``)."""
    B, A, g = valid.shape
    if keep.shape != (B, A):
        raise ValueError(f"dspark_block_stats: keep must be [B={B},A={A}], got {tuple(keep.shape)}")
    mask = valid.reshape(-1).to(torch.bool)
    n = int(mask.sum())
    if loss.tv.shape != (n,):
        raise ValueError(f"dspark_block_stats: the loss has {tuple(loss.tv.shape)} rows, valid marks {n} slots")
    accept_rows = (1.0 - loss.tv.double()).clamp(0.0, 1.0)
    accept = torch.zeros(B * A * g, dtype=torch.float64, device=valid.device)
    accept[mask] = accept_rows
    accept = accept.view(B, A, g)  # 0 at unsupervised slots: they end the product
    blocks = keep.to(torch.bool) & valid.any(dim=-1)
    w = loss.weights.double()
    if loss.confidence_logit is None:  # no confidence head: no confidence weight, no confidence metrics
        error, w_conf = torch.zeros_like(accept_rows), torch.zeros_like(w)
    else:
        error, w_conf = torch.sigmoid(loss.confidence_logit.double()) - accept_rows, w
    return DSparkStats(
        accept_sum=accept.sum(dim=(0, 1)),
        accept_count=valid.sum(dim=(0, 1)).long(),
        tau_sum=(expected_tokens_per_round(accept) * blocks).sum(),
        blocks=blocks.sum().long(),
        confidence_abs_sum=(w_conf * error.abs()).sum(),
        confidence_bias_sum=(w_conf * error).sum(),
        confidence_weight=w_conf.sum(),
        anchors=keep.sum().long(),
        rows=torch.tensor(B, dtype=torch.long, device=valid.device),
    )


class DSparkMetrics(Metric):
    """The :class:`DSparkStats` of many batches (and ranks: every state is reduced by sum)."""

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.block_size = block_size
        for field in fields(DSparkStats):
            shape = (block_size,) if field.name.startswith("accept_") else ()
            dtype = torch.long if field.name in ("accept_count", "blocks", "anchors", "rows") else torch.float64
            self.add_state(field.name, default=torch.zeros(shape, dtype=dtype), dist_reduce_fx="sum")

    def update(self, stats: DSparkStats) -> None:
        for field in fields(DSparkStats):
            value, state = getattr(stats, field.name), getattr(self, field.name)
            if value.shape != state.shape:
                raise ValueError(f"{field.name}: expected shape {tuple(state.shape)}, got {tuple(value.shape)}")
            setattr(self, field.name, state + value.detach().to(state.dtype))

    def compute(self) -> dict[str, torch.Tensor]:
        return summarize(self)


def summarize(sums) -> dict[str, torch.Tensor]:
    """The metrics of ``sums`` (a :class:`DSparkStats` of one batch, or a :class:`DSparkMetrics` of many: the same
    fields), each ratio formed only here."""
    accept = sums.accept_sum / sums.accept_count.double().clamp_min(1)
    result = {f"accept_{k}": accept[k].float() for k in range(accept.shape[0])}
    result["tau_sim"] = (sums.tau_sum / sums.blocks.double().clamp_min(1)).float()
    if sums.confidence_weight > 0:  # absent when no batch had a confidence head
        result["confidence_abs_error"] = (sums.confidence_abs_sum / sums.confidence_weight).float()
        result["confidence_bias"] = (sums.confidence_bias_sum / sums.confidence_weight).float()
    result["anchors_per_row"] = (sums.anchors.double() / sums.rows.double().clamp_min(1)).float()
    return result
