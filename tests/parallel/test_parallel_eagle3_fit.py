"""``ExpertParallelStrategy`` with the real ``Eagle3Module`` (2 forked gloo ranks, the golden K3 target).

Equivalence: every rank divides its loss by its own supervised-token count and the strategy averages the draft
gradients over the world, so a 2-rank EP=2 step on one row per rank equals a 1-rank step with
``accumulate_grad_batches=2`` over the same two rows (Lightning divides each micro-batch loss by 2).

Row order: under any distributed strategy (world size 1 included) Lightning wraps ``ChatDataModule``'s
``EpochShuffleSampler`` in a ``DistributedSamplerWrapper`` built with ``shuffle=True`` and ``seed=PL_GLOBAL_SEED``
(default 0), which permutes the sampler's order once more per epoch. Both runs use the strategy, so both see the same
permuted order; rank ``r`` of 2 takes positions ``r, r+2, ...`` of it, so step ``k`` of ranks 0 and 1 trains on
micro-batches ``2k`` and ``2k+1`` of the 1-rank run. The tests record the dataset index of every row each rank
trained on and assert that pairing instead of assuming it.

Runs (``max_epochs=2``, 2 optimizer steps per epoch, so every run has the same 4-step LR schedule):

* ``ep2``: 2 ranks, EP=2, batch 1, stopped after epoch 0 → checkpoint ``epoch=0.ckpt``;
* ``one``: 1 rank, batch 1, ``accumulate_grad_batches=2``, both epochs (``epoch=0.ckpt`` is the reference for ``ep2``);
* ``resumed``: 1 rank, like ``one``, resumed from ``ep2``'s checkpoint → must end where ``one`` ends.

``test_rank0_draft_returns_to_the_main_process``: under the fork/spawn launcher ``configure_model`` ran only in the
workers; ``Eagle3Module.load_state_dict`` must still bring rank 0's draft back into the main process.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from eagle_helpers import grouped_settings
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_eagle import Eagle3Module
from lightning_eagle.data import ChatDataModule
from lightning_eagle.parallel.dense_shard import dense_bytes_held
from lightning_eagle.parallel.dispatcher import TorchExpertDispatcher
from lightning_eagle.parallel.shard import moe_layers, routed_expert_bytes
from lightning_eagle.parallel.strategy import ExpertParallelStrategy

pytestmark = pytest.mark.multiprocess

STEPS_PER_EPOCH = 2  # optimizer steps
EPOCHS = 2
NUM_EXPERTS, NUM_MOE_LAYERS = 8, 7  # golden target: 8 layers, the first one dense


def module_kwargs(golden_dir: Path) -> dict:
    flat = {"target": str(golden_dir / "target"), "aux_layer_ids": [1, 3, 4], "target_dtype": "float32",
            "ttt_steps": 2, "lr": 1e-3}  # fmt: skip
    return grouped_settings(flat, {"intermediate_size": 64})


DATA_KWARGS = {
    "max_length": 160,
    "batch_size": 1,
    "thinking_effort": None,
    "draft_vocab_size": 320,
    "use_cache": False,
    "seed": 0,
}


class _Indexed(torch.utils.data.Dataset):
    """The training rows plus their index in the training split (to record which rows each rank trained on)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**self.dataset[i], "index": torch.tensor(i)}


class _IndexedCollate:
    def __init__(self, collate) -> None:
        self.collate = collate

    def __call__(self, rows):
        batch = self.collate([{k: v for k, v in r.items() if k != "index"} for r in rows])
        return {**batch, "index": torch.stack([r["index"] for r in rows])}


class IndexedChatData(ChatDataModule):
    """``ChatDataModule`` (its sampler, split and vocab map unchanged) whose batches also carry ``index``."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if not isinstance(self.train_dataset, _Indexed):
            self.train_dataset = _Indexed(self.train_dataset)

    def _collate(self):
        return _IndexedCollate(super()._collate())


class StopAfterFirstEpoch(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = True


class Report(pl.Callback):
    """Each rank writes what it trained on and what it ended with to ``out_dir/rank{r}.pt``."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.seen: list[int] = []

    def on_train_start(self, trainer, module):
        self.start = {k: v.detach().clone() for k, v in module.draft.state_dict().items()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.extend(batch["index"].tolist())

    def on_train_end(self, trainer, module):
        layers = [m for _, m in moe_layers(module.target)]
        optimizer = trainer.optimizers[0]
        report = {
            "world": trainer.world_size,
            "seen": self.seen,
            "global_step": trainer.global_step,
            "start": self.start,
            "draft": {k: v.detach().clone() for k, v in module.draft.state_dict().items()},
            "trainable": sorted(n for n, p in module.draft.named_parameters() if p.requires_grad),
            "optimizer": optimizer.state_dict()["state"],
            "lr": optimizer.param_groups[0]["lr"],
            "experts": [(m.experts.start, m.experts.count) for m in layers],
            "expert_bytes": routed_expert_bytes(module.target),
            "dense_bytes": dense_bytes_held(module.target),
            "dispatch_is_strategy_dispatcher": [m.dispatch is trainer.strategy.dispatcher for m in layers],
            "dispatch": [type(m.dispatch).__name__ for m in layers],
        }
        torch.save(report, self.out_dir / f"rank{trainer.global_rank}.pt")


class OneThread(pl.Callback):
    def setup(self, trainer, pl_module, stage):
        # One thread per rank: two threads per process on a contended 2-core runner is much slower, not faster.
        torch.set_num_threads(1)


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _fit(golden_dir, data, out_dir: Path, devices: int, accumulate: int, stop_after_first=False, ckpt_path=None):
    out_dir.mkdir(parents=True, exist_ok=True)
    module = Eagle3Module(**module_kwargs(golden_dir))
    callbacks = [OneThread(), Report(out_dir), ModelCheckpoint(dirpath=out_dir, filename="{epoch}", save_top_k=-1)]
    if stop_after_first:
        callbacks.insert(0, StopAfterFirstEpoch())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ExpertParallelStrategy(expert_parallel_size=devices, start_method="fork"),
        max_epochs=EPOCHS,
        limit_train_batches=STEPS_PER_EPOCH * accumulate,  # per rank
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out_dir),
        callbacks=callbacks,
    )
    main_error = None
    trainer.fit(module, data, ckpt_path=ckpt_path)
    reports = [_load(out_dir / f"rank{r}.pt") for r in range(devices)]
    main_draft = None if module.draft is None else {k: v.clone() for k, v in module.draft.state_dict().items()}
    reports[0].update(main_error=main_error, main_draft=main_draft)
    return reports


@pytest.fixture(scope="module")
def runs(golden_dir, tmp_path_factory):
    import torch._dynamo  # noqa: F401 - imported once here instead of in every forked rank

    tmp = tmp_path_factory.mktemp("ep_eagle3")
    data = IndexedChatData(**DATA_KWARGS)
    data.setup("fit")  # tokenize once; the forked ranks inherit it (setup is idempotent)
    ep2 = _fit(golden_dir, data, tmp / "ep2", devices=2, accumulate=1, stop_after_first=True)
    one = _fit(golden_dir, data, tmp / "one", devices=1, accumulate=2)
    resumed = _fit(golden_dir, data, tmp / "resumed", devices=1, accumulate=2, ckpt_path=tmp / "ep2" / "epoch=0.ckpt")
    return {
        "ep2": ep2,
        "one": one,
        "resumed": resumed,
        "ep2_ckpt": _load(tmp / "ep2" / "epoch=0.ckpt"),
        "one_epoch0": _load(tmp / "one" / "epoch=0.ckpt"),
        "one_epoch1": _load(tmp / "one" / "epoch=1.ckpt"),
        "resumed_epoch1": _load(tmp / "resumed" / "epoch=1.ckpt"),
        "dataset_len": len(data.train_dataset),
    }


def _assert_adam_state_close(actual: dict, expected: dict, **tol) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 0
    for idx, state in expected.items():
        assert actual[idx].keys() == state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        torch.testing.assert_close(actual[idx]["step"], state["step"], atol=0, rtol=0)
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(actual[idx][name], state[name], msg=f"param {idx} {name}", **tol)


def _assert_draft_close(actual: dict, expected: dict, atol=1e-6, rtol=1e-5) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 0
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, atol=atol, rtol=rtol, msg=key)


def _ckpt_draft(ckpt: dict) -> dict:
    return {k.removeprefix("draft."): v for k, v in ckpt["state_dict"].items()}


def test_each_rank_holds_half_of_the_experts_and_the_dispatcher_on_every_moe_layer(runs):
    r0, r1 = runs["ep2"]
    (single,) = runs["one"]
    assert r0["world"] == r1["world"] == 2 and single["world"] == 1
    half = NUM_EXPERTS // 2
    assert r0["experts"] == [(0, half)] * NUM_MOE_LAYERS and r1["experts"] == [(half, half)] * NUM_MOE_LAYERS
    assert single["experts"] == [(0, NUM_EXPERTS)] * NUM_MOE_LAYERS
    assert single["expert_bytes"] > 0
    assert r0["expert_bytes"] == r1["expert_bytes"] == single["expert_bytes"] // 2
    assert r0["expert_bytes"] + r1["expert_bytes"] == single["expert_bytes"]
    for report in (r0, r1):  # the strategy's one dispatcher object is installed on every MoE layer
        assert report["dispatch"] == [TorchExpertDispatcher.__name__] * NUM_MOE_LAYERS
        assert report["dispatch_is_strategy_dispatcher"] == [True] * NUM_MOE_LAYERS
    assert TorchExpertDispatcher.__name__ not in single["dispatch"]  # world size 1 keeps the local dispatch


def test_dense_target_weights_are_sharded_by_default_over_two_ranks(runs):
    """``target_shard_dense`` defaults to on for world > 1: each rank holds half of the dense bytes (± the few
    replicated root norms); one process holds them all. The fit equivalence below therefore runs sharded."""
    (single,) = runs["one"]
    for report in runs["ep2"]:
        assert abs(report["dense_bytes"] - single["dense_bytes"] / 2) < 0.01 * single["dense_bytes"]


def test_ranks_train_on_disjoint_rows_paired_like_the_accumulating_single_rank(runs):
    r0, r1 = runs["ep2"]
    (single,) = runs["one"]
    n = STEPS_PER_EPOCH
    assert len(r0["seen"]) == len(r1["seen"]) == n and not set(r0["seen"]) & set(r1["seen"])
    assert all(0 <= i < runs["dataset_len"] for i in r0["seen"] + r1["seen"])
    # Optimizer step k of the 1-rank run accumulates micro-batches 2k (rank 0's row) and 2k+1 (rank 1's row).
    assert len(single["seen"]) == EPOCHS * 2 * n
    assert single["seen"][: 2 * n] == [i for pair in zip(r0["seen"], r1["seen"]) for i in pair]
    assert single["seen"][2 * n :] != single["seen"][: 2 * n]  # epoch 1 is a new order


def test_two_rank_ep2_fit_equals_one_rank_with_accumulation(runs):
    r0, r1 = runs["ep2"]
    # Same seeded init, averaged gradients: the replicas never diverge (bitwise).
    _assert_draft_close(r1["draft"], r0["draft"], atol=0, rtol=0)
    _assert_adam_state_close(r1["optimizer"], r0["optimizer"], atol=0, rtol=0)
    ref = runs["one_epoch0"]
    assert r0["global_step"] == ref["global_step"] == STEPS_PER_EPOCH
    _assert_draft_close(r0["draft"], _ckpt_draft(ref))
    _assert_adam_state_close(r0["optimizer"], ref["optimizer_states"][0]["state"], atol=1e-9, rtol=1e-5)
    # Both runs started from the same seeded draft, and it did train: every trainable tensor moved, the rest did not.
    (single,) = runs["one"]
    _assert_draft_close(r0["start"], single["start"], atol=0, rtol=0)
    assert r0["trainable"] and "embed_tokens.weight" not in r0["trainable"]
    for key, start in r0["start"].items():
        assert torch.equal(start, r0["draft"][key]) == (key not in r0["trainable"]), key


def test_ep2_checkpoint_holds_the_draft_and_the_optimizer_moments(runs):
    ckpt = runs["ep2_ckpt"]
    assert ckpt["state_dict"] and all(k.startswith("draft.") for k in ckpt["state_dict"])
    assert {"draft.d2t", "draft.t2d"} <= set(ckpt["state_dict"])
    assert ckpt["global_step"] == STEPS_PER_EPOCH and ckpt["epoch"] == 0
    assert ckpt["lr_schedulers"][0]["last_epoch"] == runs["one_epoch0"]["lr_schedulers"][0]["last_epoch"] == 2
    r0 = runs["ep2"][0]
    _assert_draft_close(_ckpt_draft(ckpt), r0["draft"], atol=0, rtol=0)
    _assert_adam_state_close(ckpt["optimizer_states"][0]["state"], r0["optimizer"], atol=0, rtol=0)


def test_ep2_checkpoint_resumes_on_one_rank_to_the_uninterrupted_state(runs):
    (resumed,) = runs["resumed"]
    (single,) = runs["one"]
    assert resumed["global_step"] == single["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert resumed["seen"] == single["seen"][2 * STEPS_PER_EPOCH :]  # epoch 1, same rows in the same order
    assert resumed["lr"] == pytest.approx(single["lr"], rel=1e-12)
    _assert_draft_close(resumed["draft"], single["draft"])
    _assert_adam_state_close(resumed["optimizer"], single["optimizer"], atol=1e-9, rtol=1e-5)
    a, b = runs["resumed_epoch1"], runs["one_epoch1"]
    assert a["lr_schedulers"][0]["last_epoch"] == b["lr_schedulers"][0]["last_epoch"] == EPOCHS * STEPS_PER_EPOCH
    _assert_draft_close(_ckpt_draft(a), _ckpt_draft(b))


def test_rank0_draft_returns_to_the_main_process(runs):
    r0 = runs["ep2"][0]
    assert r0["main_error"] is None, repr(r0["main_error"])
    _assert_draft_close(r0["main_draft"], r0["draft"], atol=0, rtol=0)


# ---- mid-epoch resume under expert parallelism -----------------------------------------------------------------------
MID_STEPS, MID_EVERY = 4, 2


def _fit_steps(golden_dir, data, out_dir: Path, devices: int, accumulate: int, ckpt_path=None):
    """One epoch bounded by ``max_steps`` (the real config's shape: one long epoch, periodic checkpoints)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    module = Eagle3Module(**module_kwargs(golden_dir))
    every = ModelCheckpoint(dirpath=out_dir, filename="{step}", every_n_train_steps=MID_EVERY, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, max_steps=MID_STEPS, max_epochs=1, accumulate_grad_batches=accumulate,
        strategy=ExpertParallelStrategy(expert_parallel_size=devices, start_method="fork"),
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(out_dir), callbacks=[OneThread(), Report(out_dir), every],
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return [_load(out_dir / f"rank{r}.pt") for r in range(devices)]


@pytest.fixture(scope="module")
def mid_epoch_runs(golden_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_mid_epoch")
    data = IndexedChatData(**DATA_KWARGS)
    data.setup("fit")
    full = _fit_steps(golden_dir, data, tmp / "full", devices=2, accumulate=1)
    ckpt = tmp / "full" / f"step={MID_EVERY}.ckpt"
    return {
        "full": full,
        "ckpt": _load(ckpt),
        "ep2": _fit_steps(golden_dir, IndexedChatData(**DATA_KWARGS), tmp / "ep2", 2, 1, ckpt_path=ckpt),
        "one": _fit_steps(golden_dir, IndexedChatData(**DATA_KWARGS), tmp / "one", 1, 2, ckpt_path=ckpt),
    }


def test_mid_epoch_checkpoint_records_the_world_position(mid_epoch_runs):
    position = mid_epoch_runs["ckpt"]["IndexedChatData"]["train_position"]
    assert position["epoch"] == 0 and position["consumed"] == MID_EVERY * 2  # 2 steps × 1 row × 2 ranks


def test_two_rank_ep_resume_mid_epoch_equals_the_uninterrupted_run(mid_epoch_runs):
    full, ep2 = mid_epoch_runs["full"], mid_epoch_runs["ep2"]
    for rank in range(2):  # each rank trains on exactly the rows the uninterrupted rank saw after step 2
        assert ep2[rank]["seen"] == full[rank]["seen"][MID_EVERY:]
        assert ep2[rank]["global_step"] == full[rank]["global_step"] == MID_STEPS
    _assert_draft_close(ep2[0]["draft"], full[0]["draft"])
    _assert_adam_state_close(ep2[0]["optimizer"], full[0]["optimizer"], atol=1e-7, rtol=1e-5)


def test_ep_mid_epoch_checkpoint_resumes_on_one_rank(mid_epoch_runs):
    full, one = mid_epoch_runs["full"], mid_epoch_runs["one"]
    # One rank with accumulation 2 trains on rank 0's and rank 1's rows of each step, in that order.
    expected = [i for step in zip(full[0]["seen"][MID_EVERY:], full[1]["seen"][MID_EVERY:]) for i in step]
    assert one[0]["seen"] == expected
    _assert_draft_close(one[0]["draft"], full[0]["draft"])
