"""Resume a mid-epoch checkpoint on another layout (world size × batch size), e.g. 4 ranks → 1 rank with
``accumulate_grad_batches=4``.

Rows are invariant across layouts: the resumable sampler records how many rows the whole world has consumed, and
restarts every rank after them. Lightning's loop counters are not: they count this rank's *micro-batches* in the
epoch, and decide optimizer steps (``ready % accumulate_grad_batches``) and the epoch's end from them. A checkpoint
from 4 ranks at step 1 says "1 micro-batch done"; one rank accumulating 4 must read that as 4. So the checkpoint
records the rows one micro-batch takes over the whole world, and a resume under a different value rescales the epoch
counters before Lightning restores them (same rows consumed ⇒ same micro-batches done, in the new unit). Under draft
sequence parallelism a micro-batch takes ``batch_size × world / sp`` rows (a group of ``sp`` ranks shares its rows), so
a change of ``sp`` is a change of layout like any other.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_eagle.checkpoint_keys import MICRO_BATCH_ROWS as MICRO_BATCH_ROWS_KEY
from lightning_eagle.training.data_contract import FixedBatchSize, run_datamodule

_BATCH_PROGRESS = "epoch_loop.batch_progress"


def micro_batch_rows(trainer) -> int | None:
    """Rows one micro-batch takes over the whole world (None when the data module does not say its batch size): the
    batch size times the sampler's replicas — the world size, or ``world / sp`` under draft sequence parallelism,
    whose groups of ``sp`` ranks share their rows."""
    datamodule = run_datamodule(trainer)
    if not isinstance(datamodule, FixedBatchSize) or datamodule.batch_size is None:
        return None
    replicas = (trainer.distributed_sampler_kwargs or {}).get("num_replicas", trainer.world_size)
    return int(datamodule.batch_size) * int(replicas)


def rescale_epoch_progress(checkpoint: dict[str, Any], current_rows: int | None) -> None:
    """Rewrite ``checkpoint``'s micro-batch counters in place for a run whose micro-batch takes ``current_rows``."""
    saved_rows = checkpoint.get(MICRO_BATCH_ROWS_KEY)
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get(_BATCH_PROGRESS)
    if saved_rows is None or current_rows is None or saved_rows == current_rows or progress is None:
        return
    done = progress["current"]["ready"]  # saved at a batch end: ready = started = processed = completed + 1
    rows = done * saved_rows
    if rows % current_rows:
        raise ValueError(
            f"cannot resume this checkpoint here: it stopped after {rows} rows of the epoch ({done} micro-batches of "
            f"{saved_rows} rows over the world), which is not a whole number of this run's micro-batches "
            f"({current_rows} rows = world size × batch size); resume with a layout whose world size × batch size "
            f"divides {rows}"
        )
    shift = rows // current_rows - done
    for counters in (progress["current"], progress["total"]):
        for field in ("ready", "started", "processed", "completed"):
            counters[field] += shift
    checkpoint[MICRO_BATCH_ROWS_KEY] = current_rows


def rng_states_to_checkpoint(states: dict[str, Any]) -> dict[str, Any]:
    """Lightning's RNG states with numpy's key array as a tensor, so ``torch.load(weights_only=True)`` reads them."""
    out = dict(states)
    if "numpy" in out:
        name, keys, pos, has_gauss, gauss = out["numpy"]
        out["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return out


def rng_states_from_checkpoint(states: dict[str, Any]) -> dict[str, Any]:
    out = dict(states)
    if "numpy" in out:
        name, keys, pos, has_gauss, gauss = out["numpy"]
        out["numpy"] = (name, keys.numpy().astype("uint32"), pos, has_gauss, gauss)
    return out
