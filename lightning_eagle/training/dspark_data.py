"""What a DSpark run checks of its data before it spends anything: every training row it trains on must hold an
anchor (two consecutive supervised tokens, :func:`~lightning_eagle.training.dspark_anchors.anchor_candidates`), and a
block must fit in a row. EAGLE-3 refuses rows with no supervised token; a DSpark row can have supervised tokens and
still train nothing."""

from __future__ import annotations

import logging

import torch

from lightning_eagle.training.dspark_anchors import rows_with_anchors

log = logging.getLogger(__name__)


def anchor_rows(dataset) -> torch.Tensor | None:
    """``[N]`` bool per training row: holds an anchor. None when the rows cannot be read before training (a
    streaming features folder, a dataset of another kind)."""
    flat = getattr(dataset, "dataset", None)
    if hasattr(flat, "loss_mask") and hasattr(flat, "offsets") and hasattr(dataset, "indices"):  # ChatDataModule
        return rows_with_anchors(flat.loss_mask, flat.offsets)[torch.as_tensor(dataset.indices, dtype=torch.long)]
    if hasattr(dataset, "loss_masks"):  # dumped or extracted features, read whole
        return rows_with_anchors(*dataset.loss_masks())
    return None


def check_anchor_rows(datamodule) -> None:
    """Refuse a run whose training (or validation) rows hold no anchor; say how many train when only some do."""
    if datamodule is None or getattr(datamodule, "streaming", False):
        return  # a streaming folder's rows are not written yet: validation refuses an anchor-less epoch instead
    val = anchor_rows(getattr(datamodule, "val_dataset", None))
    if val is not None and val.numel() and not val.any():
        raise ValueError(
            f"no validation row holds a DSpark anchor (two consecutive supervised tokens): val/tau_sim of its "
            f"{val.numel()} rows would measure nothing. Check the validation data's loss mask"
        )
    rows = anchor_rows(getattr(datamodule, "train_dataset", None))
    if rows is None or rows.numel() == 0:
        return
    kept = int(rows.sum())
    if kept == 0:
        raise ValueError(
            f"no training row holds a DSpark anchor (two consecutive supervised tokens, loss_mask[p] and "
            f"loss_mask[p+1]): all {rows.numel()} rows would train nothing. Check the loss mask "
            "(data.loss_mask_recovery, data.last_turn_only) or train EAGLE-3, which needs one supervised token"
        )
    if kept < rows.numel():
        log.warning(
            "%d of %d training rows hold a DSpark anchor (two consecutive supervised tokens); the other %d train "
            "nothing", kept, rows.numel(), rows.numel() - kept,
        )  # fmt: skip


def check_block_fits(block_size: int, max_length: int | None) -> None:
    """A block of g slots needs g + 1 positions of one row (its anchor's next tokens): refused when no row can hold
    one (the step would allocate blocks no row can fill)."""
    if max_length is not None and block_size >= max_length:
        raise ValueError(
            f"the DSpark block size {block_size} (model.draft) is not below data.max_length {max_length}: no row can "
            f"hold a block and its labels; use a block size below {max_length} (vLLM serves g = 4..16)"
        )
