"""Exact mid-epoch resume: a run resumed from its step-N checkpoint trains on the same rows, in the same order, and
ends with the same draft as the uninterrupted run (one long epoch, like the real config)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from eagle_helpers import data_kwargs, module_kwargs, trainer_kwargs
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_eagle import ChatDataModule, Eagle3Module
from lightning_eagle.checkpoint_io import AtomicCheckpointIO, CheckpointLoadError
from lightning_eagle.data.sampler import EpochShuffleSampler, ResumableDataLoader

# -------------------------------------------------------------------------------------------------------- the sampler


def _rank_orders(n, world, epoch, consumed=0, seed=3):
    out = []
    for rank in range(world):
        sampler = EpochShuffleSampler(n, seed=seed, num_replicas=world, rank=rank)
        sampler.set_epoch(epoch)
        if consumed:
            sampler.resume_at(epoch, consumed)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("world_before, world_after", [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2)])
def test_resume_continues_the_world_order_on_any_world_size(world_before, world_after):
    n, epoch = 37, 2
    order = EpochShuffleSampler(n, seed=3).order(epoch)
    # Before: every rank took 3 rows; the world consumed 3 × world_before rows of `order`.
    consumed = 3 * world_before
    before = _rank_orders(n, world_before, epoch)
    assert sorted(i for ranks in before for i in ranks[:3]) == sorted(order[:consumed])
    after = _rank_orders(n, world_after, epoch, consumed=consumed)
    padded = order + order[: (-n) % world_after]
    for rank, rows in enumerate(after):
        assert rows == padded[consumed:][rank::world_after]


def test_ranks_partition_the_epoch_and_a_checkpoint_at_the_epoch_end_starts_the_next():
    ranks = _rank_orders(10, 2, epoch=0)
    assert sorted(ranks[0] + ranks[1]) == list(range(10)) and len(ranks[0]) == len(ranks[1]) == 5
    sampler = EpochShuffleSampler(10, seed=3)
    sampler.resume_at(epoch=0, consumed=10)  # saved at the last batch of epoch 0
    sampler.set_epoch(1)  # Lightning moves on to epoch 1: nothing is skipped there
    assert list(sampler) == EpochShuffleSampler(10, seed=3).order(1)


def test_loader_state_counts_rows_handed_out_and_refuses_other_data():
    sampler = EpochShuffleSampler(20, seed=1, num_replicas=2, rank=1)
    loader = ResumableDataLoader(list(range(20)), batch_size=3, sampler=sampler, collate_fn=torch.tensor)
    it = iter(loader)
    next(it), next(it)
    assert loader.state_dict() == {"epoch": 0, "consumed": 12, "seed": 1, "num_rows": 20}  # 2 batches × 3 × 2 ranks
    again = EpochShuffleSampler(20, seed=1, num_replicas=2, rank=1)
    fresh = ResumableDataLoader(list(range(20)), batch_size=3, sampler=again, collate_fn=torch.tensor)
    fresh.load_state_dict(loader.state_dict())
    assert torch.cat(list(fresh)).tolist() == torch.cat(list(it)).tolist()
    with pytest.raises(ValueError, match="21 training rows shuffled with seed 1, this run has 20 rows"):
        fresh.load_state_dict({**loader.state_dict(), "num_rows": 21})


# -------------------------------------------------------------------------------------------------------- the trainer


class RecordRows(pl.Callback):
    """Remembers every training batch's input ids (to compare the row order of two runs)."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch["input_ids"].clone())


def _fit(target_dir, root, max_steps, ckpt_path=None, every=None):
    torch.manual_seed(0)
    data = ChatDataModule(**data_kwargs(batch_size=2))
    module = Eagle3Module(**module_kwargs(target_dir))
    record = RecordRows()
    callbacks = [record]
    if every:
        callbacks.append(
            ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1, save_last=True)
        )
    trainer = pl.Trainer(**trainer_kwargs(root, max_steps=max_steps, max_epochs=1, callbacks=callbacks,
                                          enable_checkpointing=bool(every), limit_val_batches=0))  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, record.batches, trainer


@pytest.mark.slow
def test_mid_epoch_resume_reproduces_the_uninterrupted_run(target_dir, tmp_path):
    full, full_batches, _ = _fit(target_dir, tmp_path / "full", max_steps=6)
    _, first_batches, trainer = _fit(target_dir, tmp_path / "cut", max_steps=6, every=2)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    ckpt = tmp_path / "cut" / "ckpt" / "epoch=0-step=2.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    position = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert position == [{"epoch": 0, "consumed": 4, "seed": 0, "num_rows": 377}]  # 2 steps × batch 2
    resumed, resumed_batches, _ = _fit(target_dir, tmp_path / "resumed", max_steps=6, ckpt_path=ckpt)
    assert len(resumed_batches) == 4  # steps 3..6 only: nothing replayed, the tail is reached
    for a, b in zip(resumed_batches, full_batches[2:]):
        assert torch.equal(a, b)  # exact: the same rows (token ids), in the same order
    for name, value in full.draft.state_dict().items():
        torch.testing.assert_close(resumed.draft.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert len(first_batches) == 6


def test_truncated_checkpoint_is_a_clear_error(target_dir, tmp_path):
    bad = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"draft.w": torch.zeros(1000)}}, bad)
    bad.write_bytes(bad.read_bytes()[:2000])  # what a kill during a non-atomic save leaves
    with pytest.raises(
        CheckpointLoadError, match=r"last.ckpt' \(2000 bytes\) cannot be read: it is truncated or corrupt"
    ):
        _fit(target_dir, tmp_path / "run", max_steps=1, ckpt_path=bad)
