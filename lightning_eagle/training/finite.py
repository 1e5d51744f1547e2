"""The run stops on a non-finite loss, gradient norm or updated weight, on every rank together: a step on NaN/inf
makes the draft garbage, which the run would otherwise checkpoint and export with exit 0."""

from __future__ import annotations

import torch

from lightning_eagle.errors import NonFiniteTrainingError
from lightning_eagle.parallel.dense_shard import is_sharded


def stop_unless_finite(module, what: str, value: torch.Tensor, batch_idx: int) -> None:
    """Raise :class:`NonFiniteTrainingError` when ``value`` is NaN/inf on any rank (checked on the loss before the
    backward, the gradient norm before the optimizer step, the updated weights before any callback can save them)."""
    finite = bool(torch.isfinite(value.detach()).all())
    if module._trainer is not None:  # every rank decides together, or the others hang in the next collective
        finite = module.trainer.strategy.reduce_boolean_decision(finite, all=True)
    if not finite:
        shown = value.detach().float().flatten()[:1].item() if value.numel() else value
        raise NonFiniteTrainingError(
            f"{what} is not finite ({shown}) at global step {module.global_step} (batch {batch_idx}, on this or "
            "another rank): the run is stopped, nothing of this step is checkpointed or exported. Usual causes: "
            "a learning rate that diverges, corrupted or mismatched features, NaN/inf in the inputs; resume from "
            "the last good checkpoint once fixed"
        )


def updated_weights_sum(module) -> torch.Tensor:
    """Σ|w| over this rank's trainable draft weights (its shards of FSDP2 DTensors): finite iff every weight is."""
    local = [(p.to_local() if is_sharded(p) else p).detach() for p in module.trainable_parameters()]
    return torch.stack([t.float().abs().sum() for t in local]).sum()
