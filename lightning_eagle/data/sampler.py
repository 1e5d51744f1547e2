"""Training-row order that a checkpoint can resume mid-epoch, exactly, on any world size.

The order of epoch ``e`` is a permutation that depends only on ``(seed, e)``. It is padded to a multiple of the
world size (the first rows repeated, like ``DistributedSampler``) and rank ``r`` of ``W`` takes positions
``r, r+W, r+2W, …`` of what is left after the ``consumed`` rows the whole world has already trained on:

    order_e = randperm(N; seed, e)      rank_r = order_e[consumed:][r::W]

Because a rank's i-th row is ``order_e[consumed + i·W + r]`` whatever ``consumed`` is, a run resumed at ``consumed``
trains on exactly the rows the uninterrupted run would have trained on next — also when the world size changes
between the two runs. :class:`ResumableDataLoader` counts the rows its iterator has handed out (in the main process,
so loader workers' prefetching does not count) and exposes ``state_dict``/``load_state_dict``, which Lightning's fit
loop saves with every checkpoint and restores before the first batch of a resumed run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override


class EpochShuffleSampler(DistributedSampler):
    """Seeded per-epoch permutation, sharded over ``num_replicas`` ranks, resumable at any row.

    A ``DistributedSampler`` subclass only so that Lightning leaves it in place (it shards itself). Lightning calls
    ``set_epoch`` at every epoch start; each pass also advances the epoch by one, so a plain
    ``for epoch …: for batch in loader`` loop sees a new order every time.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True, num_replicas: int = 1, rank: int = 0):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        # No super().__init__: it would query torch.distributed; every field it sets is set here.
        self.num_samples_total, self.seed, self.shuffle = num_samples, seed, shuffle
        self.num_replicas, self.rank, self.epoch = num_replicas, rank, 0
        self.drop_last = False
        self._resume: tuple[int, int] | None = None  # (epoch, rows consumed by the world) from a checkpoint
        self.pass_epoch, self.pass_start = 0, 0  # the epoch and start row of the pass in progress

    @override
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        """The whole world's order of epoch ``epoch``, padded to a multiple of the world size."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_samples_total, generator=generator).tolist()
        else:
            order = list(range(self.num_samples_total))
        padded = self._padded_total()
        while len(order) < padded:
            order += order[: padded - len(order)]
        return order

    def _padded_total(self) -> int:
        return -(-self.num_samples_total // self.num_replicas) * self.num_replicas

    def resume_at(self, epoch: int, consumed: int) -> None:
        """Start the next pass of ``epoch`` after the first ``consumed`` rows of the world's order."""
        if not 0 <= consumed <= self._padded_total():
            raise ValueError(f"cannot resume at row {consumed} of an epoch of {self._padded_total()} rows")
        self._resume = (epoch, consumed)

    @override
    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        start = 0
        if self._resume is not None:
            resume_epoch, consumed = self._resume
            self._resume = None
            if resume_epoch == epoch:  # a checkpoint taken at the end of an epoch resumes at the next one: no skip
                start = consumed
        self.pass_epoch, self.pass_start = epoch, start
        return iter(self.order(epoch)[start:][self.rank :: self.num_replicas])

    @override
    def __len__(self) -> int:
        """Rows of a whole epoch on this rank (Lightning counts a resumed epoch's batches from its start)."""
        return self._padded_total() // self.num_replicas


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over an :class:`EpochShuffleSampler` whose position is saved in Lightning checkpoints.

    ``state_dict()`` = ``{"epoch", "consumed", "seed", "num_rows"}``, where ``consumed`` counts rows of the whole
    world (this rank's rows × world size): ranks stay in lock step, and the count is meaningful on any world size.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, EpochShuffleSampler):
            raise TypeError(f"ResumableDataLoader needs an EpochShuffleSampler, got {type(self.sampler).__name__}")
        self._rows_handed_out = 0

    @override
    def __iter__(self):
        iterator = super().__iter__()  # runs the sampler's __iter__ lazily: pass_* are set at the first batch
        self._rows_handed_out = 0
        for batch in iterator:
            self._rows_handed_out += _rows_in(batch)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        sampler: EpochShuffleSampler = self.sampler
        return {
            "epoch": sampler.pass_epoch,
            "consumed": sampler.pass_start + self._rows_handed_out * sampler.num_replicas,
            "seed": sampler.seed,
            "num_rows": sampler.num_samples_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler: EpochShuffleSampler = self.sampler
        if state.get("num_rows") != sampler.num_samples_total or state.get("seed") != sampler.seed:
            raise ValueError(
                f"the checkpoint's data position is for {state.get('num_rows')} training rows shuffled with seed "
                f"{state.get('seed')}, this run has {sampler.num_samples_total} rows and seed {sampler.seed}: "
                "resuming would train on other rows than the interrupted run"
            )
        sampler.resume_at(int(state["epoch"]), int(state["consumed"]))


def _rows_in(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return int(batch.shape[0])


class ResumableTrainLoader:
    """Mixin for data modules: one :class:`EpochShuffleSampler` per module (repeated calls keep advancing epochs),
    sharded over the trainer's data-parallel world, and its position saved/restored through the data module's
    ``state_dict`` — which Lightning always restores, also when ``configure_optimizers`` built the train loader
    early (``trainer.estimated_stepping_batches``), a case in which its fit loop skips the loader's own state."""

    _train_sampler: EpochShuffleSampler | None = None
    _train_loader: ResumableDataLoader | None = None
    _pending_position: dict[str, Any] | None = None

    def resumable_train_loader(self, dataset, *, batch_size: int, seed: int, shuffle: bool, **loader_kwargs):
        if self._train_sampler is None:
            trainer = getattr(self, "trainer", None)
            shard = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
            self._train_sampler = EpochShuffleSampler(
                len(dataset), seed, shuffle, num_replicas=shard.get("num_replicas", 1), rank=shard.get("rank", 0)
            )
        self._train_loader = ResumableDataLoader(dataset, batch_size=batch_size, sampler=self._train_sampler,
                                                 **loader_kwargs)  # fmt: skip
        if self._pending_position is not None:  # a checkpoint was loaded before the loader existed
            self._train_loader.load_state_dict(self._pending_position)
            self._pending_position = None
        return self._train_loader

    def train_position(self) -> dict[str, Any] | None:
        return self._train_loader.state_dict() if self._train_loader is not None else None

    def restore_train_position(self, position: dict[str, Any] | None) -> None:
        if position is not None and self._train_loader is not None:
            self._train_loader.load_state_dict(position)
        else:
            self._pending_position = position
