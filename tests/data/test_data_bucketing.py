"""Length-bucketed batching (``bucket_batches``): less padding than the plain order, deterministic in (seed, epoch),
every row once per epoch, and an exact mid-epoch resume at any row, also on another world size."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lightning_eagle.data import ChatDataModule
from lightning_eagle.data.dataset import collate_chat_rows
from lightning_eagle.data.sampler import EpochShuffleSampler, ResumableDataLoader
from lightning_eagle.features import format as fmt
from lightning_eagle.features.rows import FeatureRows

B, M = 4, 4  # per-rank batch size, batches per sorting window


def _mixed_lengths(n: int = 96, seed: int = 0) -> list[int]:
    """Lengths spread over two orders of magnitude (short replies and long documents)."""
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(8, 64, (n // 2,), generator=g)
    long = torch.randint(256, 2048, (n - n // 2,), generator=g)
    return torch.cat([short, long])[torch.randperm(n, generator=g)].tolist()


class _Rows(torch.utils.data.Dataset):
    """Rows whose ids are their index and whose length is given; supervised everywhere."""

    def __init__(self, lengths: list[int]) -> None:
        self._lengths = lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = self._lengths[i]
        return {"input_ids": torch.full((n,), i), "loss_mask": torch.ones(n, dtype=torch.long)}

    def lengths(self) -> torch.Tensor:
        return torch.tensor(self._lengths)


def _sampler(lengths, world=1, rank=0, bucket=M, batch=B, seed=7, shuffle=True) -> EpochShuffleSampler:
    return EpochShuffleSampler(len(lengths), seed, shuffle, num_replicas=world, rank=rank, lengths=lengths,
                               batch_size=batch, bucket_batches=bucket)  # fmt: skip


def _loader(lengths, **kw) -> ResumableDataLoader:
    data = _Rows(lengths)
    return ResumableDataLoader(data, batch_size=kw.get("batch", B), sampler=_sampler(lengths, **kw),
                               collate_fn=lambda rows: collate_chat_rows(rows, pad_token_id=0))  # fmt: skip


def _padding_fraction(loader) -> float:
    padded = real = 0
    for batch in loader:
        padded += batch["input_ids"].numel()
        real += int(batch["attention_mask"].sum())
    return 1 - real / padded


def _row_ids(batch) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def test_bucketing_cuts_padding_and_keeps_every_row_once():
    lengths = _mixed_lengths()
    plain = ResumableDataLoader(_Rows(lengths), batch_size=B, sampler=_sampler(lengths, bucket=None),
                                collate_fn=lambda rows: collate_chat_rows(rows, 0))  # fmt: skip
    plain_pad = _padding_fraction(plain)
    pads = [_padding_fraction(_loader(lengths, bucket=m)) for m in (1, 4, 16)]
    # one batch per window holds the plain batches' rows (one rank); wider windows pad less
    assert pads[0] == pytest.approx(plain_pad, abs=1e-12)
    assert pads[2] < pads[1] < 0.6 * plain_pad and pads[2] < 0.25 * plain_pad, (plain_pad, pads)
    bucketed = _loader(lengths)
    for epoch in range(2):
        rows = [i for batch in bucketed for i in _row_ids(batch)]
        assert sorted(rows) == list(range(len(lengths))), epoch
    # within a batch, rows are neighbours in length: each batch is a run of one window's sorted lengths
    sampler = _sampler(lengths)
    order = sampler.order(0)
    perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(7 * 1_000_003)).tolist()
    for w in range(0, len(order), B * M):
        window = order[w : w + B * M]
        assert sorted(window) == sorted(perm[w : w + B * M])  # a window is the permutation's window, reordered
        ranked = sorted(perm[w : w + B * M], key=lambda i: lengths[i])  # stable: ties in permutation order
        sorted_batches = sorted(sorted(ranked[p : p + B]) for p in range(0, len(ranked), B))
        assert sorted(sorted(window[b : b + B]) for b in range(0, len(window), B)) == sorted_batches


def test_bucketed_order_is_deterministic_in_seed_and_epoch():
    lengths = _mixed_lengths()
    a, b = _sampler(lengths), _sampler(lengths)
    assert a.order(0) == b.order(0) and a.order(1) == b.order(1)
    assert a.order(0) != a.order(1) and a.order(0) != _sampler(lengths, seed=8).order(0)
    # the plain order is today's: bucketing off changes nothing
    plain = EpochShuffleSampler(len(lengths), 7, True)
    assert _sampler(lengths, bucket=None).order(3) == plain.order(3)
    # shuffle off: windows sorted by length, batches in that order
    fixed = _sampler(lengths, shuffle=False).order(0)
    assert fixed == [i for w in range(0, 96, B * M) for i in sorted(range(w, w + B * M), key=lambda i: lengths[i])]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_take_whole_batches_and_each_row_once(world):
    lengths = _mixed_lengths(n=90)  # not a multiple of world * B: a short last step, padding repeats the first rows
    samplers = [_sampler(lengths, world=world, rank=r) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0])
    order = samplers[0].order(0)
    counts = Counter(i for p in per_rank for i in p)
    assert counts == Counter(order) and set(counts) == set(range(90))
    for r, rows in enumerate(per_rank):  # full world steps: rank r's batch is the r-th B rows of the step
        for s in range(len(order) // (world * B)):
            assert rows[s * B : (s + 1) * B] == order[s * world * B + r * B : s * world * B + (r + 1) * B]


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 3), (3, 1), (1, 4)])
def test_resume_at_any_row_on_another_world_size_trains_exactly_the_rest(old_world, new_world):
    lengths = _mixed_lengths(n=72)  # a multiple of 1..4 and of every world * B here: no padding rows
    order = _sampler(lengths).order(2)
    for consumed in [*range(0, 73, 5), 72]:
        resumed = [_sampler(lengths, world=new_world, rank=r) for r in range(new_world)]
        for s in resumed:
            s.set_epoch(2)
            s.resume_at(2, consumed)
        rest = [i for s in resumed for i in s]
        assert Counter(rest) == Counter(order[consumed:]), consumed  # exactly the remaining rows
        assert set(rest).isdisjoint(order[:consumed])

    # through the loaders' state, as a checkpoint carries it: stop after 3 steps on old_world ranks, go on on new_world
    loaders = [_loader(lengths, world=old_world, rank=r) for r in range(old_world)]
    done = []
    for loader in loaders:
        it = iter(loader)
        done += [i for _ in range(3) for i in _row_ids(next(it))]
    state = loaders[0].state_dict()
    assert state["consumed"] == 3 * old_world * B and state["bucketing"] == {"batch_size": B, "bucket_batches": M}
    assert Counter(done) == Counter(order_of(lengths, epoch=0)[: 3 * old_world * B])
    rest = []
    for r in range(new_world):
        loader = _loader(lengths, world=new_world, rank=r)
        loader.load_state_dict(state)
        rest += [i for batch in loader for i in _row_ids(batch)]
    assert sorted(done + rest) == list(range(72))


def order_of(lengths, epoch: int) -> list[int]:
    return _sampler(lengths).order(epoch)


def test_a_bucketed_position_refuses_other_bucketing_or_batch_size():
    lengths = _mixed_lengths(n=40)
    state = _loader(lengths).state_dict()
    for other in (_loader(lengths, batch=2), _loader(lengths, bucket=2), _loader(lengths, bucket=None)):
        with pytest.raises(ValueError, match="length bucketing"):
            other.load_state_dict(state)
    _loader(lengths).load_state_dict(state)  # the same settings resume
    with pytest.raises(ValueError, match="one length per row"):
        EpochShuffleSampler(5, 0, lengths=[1, 2], batch_size=2, bucket_batches=2)
    with pytest.raises(ValueError, match="bucket_batches must be a positive int"):
        EpochShuffleSampler(2, 0, lengths=[1, 2], batch_size=2, bucket_batches=0)


def test_datamodule_bucket_batches(tmp_path, jsonl_writer):
    def chat(i: int) -> dict:
        return {"messages": [{"role": "user", "content": "q" * (5 + (37 * i) % 300)},
                             {"role": "assistant", "content": "a" * (3 + (53 * i) % 200)}]}  # fmt: skip

    rows = [chat(i) for i in range(48)]
    path = jsonl_writer("mixed.jsonl", rows)
    common = {"train_files": [str(path)], "batch_size": 4, "val_fraction": 0, "cache_dir": str(tmp_path),
              "thinking_effort": None}  # fmt: skip
    plain, bucketed = ChatDataModule(**common), ChatDataModule(**common, bucket_batches=6)
    for dm in (plain, bucketed):
        dm.setup("fit")
    lengths = bucketed.train_dataset.lengths()
    assert lengths.tolist() == [len(bucketed.train_dataset[i]["input_ids"]) for i in range(48)]
    assert _padding_fraction(bucketed.train_dataloader()) < 0.5 * _padding_fraction(plain.train_dataloader())
    assert bucketed.state_dict()["train_position"]["bucketing"] == {"batch_size": 4, "bucket_batches": 6}
    with pytest.raises(ValueError, match="data.bucket_batches"):
        ChatDataModule(**common, bucket_batches=2, pad_to_max_length=True)
    with pytest.raises(ValueError, match="data.bucket_batches must be an integer > 0"):
        ChatDataModule(**common, bucket_batches=0)


def test_feature_rows_lengths_span_shards(tmp_path):
    """The offline data module sorts by the dumped rows' lengths, read from the shards' offsets."""
    lengths = [3, 9, 4, 12, 7, 5, 8]
    shard_rows = 3
    shards = []
    for k in range(0, len(lengths), shard_rows):
        part = lengths[k : k + shard_rows]
        rows = fmt.ShardRows([torch.zeros(n, dtype=torch.long) for n in part],
                             [torch.ones(n, dtype=torch.long) for n in part],
                             [torch.zeros(n, 6) for n in part], [torch.zeros(n, 2) for n in part],
                             list(range(k, k + len(part))))  # fmt: skip
        shards.append(fmt.write_shard(tmp_path, k // shard_rows, rows, torch.float32))
    manifest = {"shard_rows": shard_rows, "shards": shards}
    for start, stop in [(0, 7), (1, 5), (4, 7), (3, 6), (2, 2)]:
        rows = FeatureRows(tmp_path, manifest, start, stop)
        assert rows.lengths().tolist() == lengths[start:stop]
        assert [int(rows[i]["input_ids"].numel()) for i in range(len(rows))] == lengths[start:stop]
