"""Training-row order that a checkpoint can resume mid-epoch, exactly, on any world size.

The order of epoch ``e`` is a permutation that depends only on ``(seed, e)``. It is padded to a multiple of the
world size (the first rows repeated, like ``DistributedSampler``) and rank ``r`` of ``W`` takes positions
``r, r+W, r+2W, …`` of what is left after the ``consumed`` rows the whole world has already trained on:

    order_e = randperm(N; seed, e)      rank_r = order_e[consumed:][r::W]

Because a rank's i-th row is ``order_e[consumed + i·W + r]`` whatever ``consumed`` is, a run resumed at ``consumed``
trains on exactly the rows the uninterrupted run would have trained on next — also when the world size changes
between the two runs.

Length bucketing (``bucket_batches=m``, with the rows' lengths and the per-rank ``batch_size`` B) reorders each epoch
so that a batch holds rows of similar length (padded only to its longest): the permutation is cut into windows of
``m·B`` rows, each window is sorted by length (stable: ties keep the permutation's order) and cut into batches of B,
and the full batches of a window are shuffled by the same ``(seed, e)`` generator (the one short batch, if any, stays
last in the epoch). The world then takes whole batches: after ``consumed`` rows, world step ``s`` is ``rest[s·W·B :
(s+1)·W·B]`` of ``rest = order_e[consumed:]`` and rank ``r`` takes its ``r``-th B rows; the final ``< W·B`` rows are
shared as above (``[r::W]``). A rank's i-th row is again a function of ``(consumed, i, W, r)`` alone, so resuming is
exact on any world size; the order depends on B, so a bucketed position refuses another batch size.

Segments (``segments=[0, b_1, …, N]``: rows that become available together, e.g. the shards a producer is still
writing) keep the epoch in segment order and shuffle only within each segment, so a reader never waits for a row of a
later segment while an earlier one is unfinished; a position saved with segments refuses other segments.

:class:`ResumableDataLoader` counts the rows its iterator has handed out (in the main process,
so loader workers' prefetching does not count) and exposes ``state_dict``/``load_state_dict``, which Lightning's fit
loop saves with every checkpoint and restores before the first batch of a resumed run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
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

    def __init__(
        self,
        num_samples: int,
        seed: int,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
        *,
        lengths: Sequence[int] | torch.Tensor | None = None,
        batch_size: int | None = None,
        bucket_batches: int | None = None,
        segments: Sequence[int] | None = None,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.lengths: torch.Tensor | None = None
        if bucket_batches is not None:
            if isinstance(bucket_batches, bool) or not isinstance(bucket_batches, int) or bucket_batches < 1:
                raise ValueError(f"bucket_batches must be a positive int or None, got {bucket_batches!r}")
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"length bucketing needs a positive batch_size, got {batch_size!r}")
            if lengths is None or len(lengths) != num_samples:
                got = None if lengths is None else len(lengths)
                raise ValueError(f"length bucketing needs one length per row: {num_samples} rows, {got} lengths")
            self.lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
        self.batch_size, self.bucket_batches = batch_size, bucket_batches
        self.segments = None if segments is None else [int(b) for b in segments]
        if self.segments is not None:
            if bucket_batches is not None:
                raise ValueError("length bucketing and segments (streaming features) cannot be combined")
            if self.segments[0] != 0 or self.segments[-1] != num_samples or self.segments != sorted(self.segments):
                raise ValueError(f"segments must rise from 0 to {num_samples}, got {self.segments[:3]}…")
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
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        if self.shuffle and self.segments is not None:
            order = [a + i for a, b in zip(self.segments, self.segments[1:])
                     for i in torch.randperm(b - a, generator=generator).tolist()]  # fmt: skip
        elif self.shuffle:
            order = torch.randperm(self.num_samples_total, generator=generator).tolist()
        else:
            order = list(range(self.num_samples_total))
        if self.bucket_batches is not None:
            order = self._bucketed(order, generator)
        padded = self._padded_total()
        while len(order) < padded:
            order += order[: padded - len(order)]
        return order

    def _bucketed(self, order: list[int], generator: torch.Generator) -> list[int]:
        """Windows of ``bucket_batches·batch_size`` rows sorted by length, cut into batches, full batches shuffled."""
        assert self.lengths is not None and self.batch_size is not None and self.bucket_batches is not None
        B, window = self.batch_size, self.batch_size * self.bucket_batches
        rows, out, tail = torch.tensor(order, dtype=torch.int64), [], []
        for start in range(0, rows.numel(), window):
            part = rows[start : start + window]
            part = part[torch.sort(self.lengths[part], stable=True).indices]
            n_full = part.numel() // B
            batches = part[: n_full * B].view(n_full, B)
            if self.shuffle:
                batches = batches[torch.randperm(n_full, generator=generator)]
            out.append(batches.reshape(-1))
            tail.append(part[n_full * B :])  # non-empty only in the last window (the others hold m·B rows)
        return torch.cat(out + tail).tolist() if out else []

    def _rank_rows(self, rest: list[int]) -> list[int]:
        """This rank's rows of ``rest`` (the world's order after the consumed rows)."""
        W, r = self.num_replicas, self.rank
        if self.bucket_batches is None:
            return rest[r::W]
        B = self.batch_size
        step = W * B
        full = len(rest) // step * step
        mine = [i for s in range(0, full, step) for i in rest[s + r * B : s + (r + 1) * B]]
        return mine + rest[full:][r::W]

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
        return iter(self._rank_rows(self.order(epoch)[start:]))

    @override
    def __len__(self) -> int:
        """Rows of a whole epoch on this rank (Lightning counts a resumed epoch's batches from its start)."""
        return self._padded_total() // self.num_replicas


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over an :class:`EpochShuffleSampler` whose position is saved in Lightning checkpoints.

    ``state_dict()`` = ``{"epoch", "consumed", "seed", "num_rows"}``, where ``consumed`` counts rows of the whole
    world (this rank's rows × world size): ranks stay in lock step, and the count is meaningful on any world size.
    With length bucketing it adds ``"bucketing": {"batch_size", "bucket_batches"}`` (the order depends on both).
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
        state = {
            "epoch": sampler.pass_epoch,
            "consumed": sampler.pass_start + self._rows_handed_out * sampler.num_replicas,
            "seed": sampler.seed,
            "num_rows": sampler.num_samples_total,
        }
        bucketing = _bucketing(sampler)
        if sampler.segments is not None:
            state["segments"] = _segments(sampler)
        return state if bucketing is None else {**state, "bucketing": bucketing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler: EpochShuffleSampler = self.sampler
        if state.get("num_rows") != sampler.num_samples_total or state.get("seed") != sampler.seed:
            raise ValueError(
                f"the checkpoint's data position is for {state.get('num_rows')} training rows shuffled with seed "
                f"{state.get('seed')}, this run has {sampler.num_samples_total} rows and seed {sampler.seed}: "
                "resuming would train on other rows than the interrupted run"
            )
        theirs, mine = state.get("bucketing"), _bucketing(sampler)
        if theirs != mine:
            raise ValueError(
                f"the checkpoint's data position is for length bucketing {theirs}, this run has {mine} "
                "(data.bucket_batches and data.batch_size): the row order would differ; resume with the checkpoint's "
                "settings"
            )
        if state.get("segments") != _segments(sampler):
            raise ValueError(
                f"the checkpoint's data position is for an order in segments {state.get('segments')}, this run's is "
                f"{_segments(sampler)} (streaming features are read shard by shard): the row order would differ"
            )
        sampler.resume_at(int(state["epoch"]), int(state["consumed"]))


def _bucketing(sampler: EpochShuffleSampler) -> dict[str, int] | None:
    if sampler.bucket_batches is None:
        return None
    return {"batch_size": sampler.batch_size, "bucket_batches": sampler.bucket_batches}


def _segments(sampler: EpochShuffleSampler) -> str | None:
    if sampler.segments is None:
        return None
    return hashlib.sha256(json.dumps(sampler.segments).encode()).hexdigest()[:16]


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

    def resumable_train_loader(
        self,
        dataset,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool,
        bucket_batches: int | None = None,
        segments: Sequence[int] | None = None,
        **loader_kwargs,
    ):
        """``bucket_batches``: length bucketing (see the module docstring); needs ``dataset.lengths()``.
        ``segments``: rows shuffled only within each segment (rows that become available together)."""
        if self._train_sampler is None:
            trainer = getattr(self, "trainer", None)
            shard = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
            lengths = dataset.lengths() if bucket_batches is not None else None
            self._train_sampler = EpochShuffleSampler(
                len(dataset), seed, shuffle, num_replicas=shard.get("num_replicas", 1), rank=shard.get("rank", 0),
                lengths=lengths, batch_size=batch_size, bucket_batches=bucket_batches, segments=segments,
            )  # fmt: skip
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
