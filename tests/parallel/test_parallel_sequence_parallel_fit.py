"""Draft sequence parallelism end to end: ``Eagle3Module`` under ``ExpertParallelStrategy`` (forked gloo ranks, the
golden K3 target) with ``draft_sequence_parallel_size=2``.

Rows: with ``sp = 2`` on 2 ranks the sampler has one replica (``world / sp``), so both ranks train on the rows a
1-rank run trains on, in the same order — the two fits are the same computation split differently, and every step
must agree: the logged loss (the group's sum of the ranks' shares), the reduced gradients (the same on both ranks),
the updated weights and AdamW moments. The SP runs use the chunked loss backend with activation checkpointing (the
long-context settings); the unit test of the unroll covers the plain backend too.

Resume across a change of the draft's SP size (checkpoints every 2 steps, ``max_steps=4``):

* sp=2 (world 2) → sp=1 (world 1): same rows per micro-batch, so the resumed run must end where the uninterrupted
  1-rank run ends;
* sp=1 (world 1) → sp=2 (world 2): the same, the other way;
* sp=2 (world 2) → sp=1 (world 2, data-parallel 2): a micro-batch now takes 2 rows; the resumed ranks must train on
  exactly the rows after the consumed count, ``order[consumed:][r::2]``, with the draft and optimizer state loaded.
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
from lightning_eagle.parallel.strategy import ExpertParallelStrategy

pytestmark = pytest.mark.multiprocess

STEPS, EVERY = 4, 2
SP_SETTINGS = {"loss_backend": "chunked", "loss_chunk": 16, "draft_activation_checkpointing": True}
DATA_KWARGS = {"max_length": 96, "batch_size": 1, "thinking_effort": None, "draft_vocab_size": 320,
               "use_cache": False, "seed": 0}  # fmt: skip


def module_kwargs(golden_dir: Path, **overrides) -> dict:
    flat = {"target": str(golden_dir / "target"), "aux_layer_ids": [1, 3, 4], "target_dtype": "float32",
            "ttt_steps": 3, "lr": 1e-3, **SP_SETTINGS, **overrides}  # fmt: skip
    return grouped_settings(flat, {"intermediate_size": 64})


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**self.dataset[i], "index": torch.tensor(i)}


class IndexedChatData(ChatDataModule):
    """``ChatDataModule`` whose batches also carry each row's ``index`` in the training split, with every real token
    supervised: the chat rows' ~76-token system prompt would otherwise leave the first half of a 96-token row (rank
    0's slots) without any supervised slot."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if not isinstance(self.train_dataset, _Indexed):
            self.train_dataset = _Indexed(self.train_dataset)

    def _collate(self):
        collate = super()._collate()

        def with_index(rows):
            batch = collate([{k: v for k, v in r.items() if k != "index"} for r in rows])
            batch["loss_mask"] = batch["attention_mask"].clone()
            if "index" not in rows[0]:  # a validation row
                return batch
            return {**batch, "index": torch.stack([r["index"] for r in rows])}

        return with_index


class Report(pl.Callback):
    """Each rank records its rows, logged losses and reduced gradients per step, then its final state."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.seen, self.losses, self.shares, self.grads = out_dir, [], [], [], []

    def setup(self, trainer, pl_module, stage):
        torch.set_num_threads(1)  # one thread per rank on a contended 2-core runner

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append(batch["index"].tolist())

    def on_before_optimizer_step(self, trainer, module, optimizer):  # after the strategy's gradient reduction
        self.grads.append({n: p.grad.clone() for n, p in module.draft.named_parameters() if p.grad is not None})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train/loss"].item())  # what the module logs
        self.shares.append(outputs["loss"].item())  # what this rank backpropagated

    def on_validation_end(self, trainer, module):
        self.val = {k: trainer.callback_metrics[k].item() for k in ("val/loss", "val/tau_sim", "val/acc_0")}

    def on_train_end(self, trainer, module):
        report = {
            "val": getattr(self, "val", None),
            "seen": self.seen, "losses": self.losses, "shares": self.shares, "grads": self.grads,
            "global_step": trainer.global_step, "sp": trainer.strategy.draft_sequence_parallel_size,
            "draft": {k: v.detach().clone() for k, v in module.draft.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict()["state"],
        }  # fmt: skip
        torch.save(report, self.out_dir / f"rank{trainer.global_rank}.pt")


def _fit(golden_dir, data, out_dir: Path, devices: int, sp: int, ckpt_path=None, **overrides):
    out_dir.mkdir(parents=True, exist_ok=True)
    module = Eagle3Module(**module_kwargs(golden_dir, **overrides))
    every = ModelCheckpoint(dirpath=out_dir, filename="{step}", every_n_train_steps=EVERY, save_top_k=-1)
    strategy = ExpertParallelStrategy(expert_parallel_size=devices, draft_sequence_parallel_size=sp,
                                      start_method="fork")  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, max_epochs=1,
        limit_val_batches=2, val_check_interval=STEPS, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(out_dir), callbacks=[Report(out_dir), every],
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def _data():
    data = IndexedChatData(**DATA_KWARGS)
    data.setup("fit")  # tokenize once; forked ranks inherit it
    return data


@pytest.fixture(scope="module")
def runs(golden_dir, tmp_path_factory):
    import torch._dynamo  # noqa: F401 - imported once here instead of in every forked rank

    tmp = tmp_path_factory.mktemp("sp_fit")
    return {
        "tmp": tmp,
        "sp2": _fit(golden_dir, _data(), tmp / "sp2", devices=2, sp=2),
        "one": _fit(golden_dir, _data(), tmp / "one", devices=1, sp=1),
    }


def _close(actual: dict, expected: dict, **tol) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 5
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, msg=lambda m, key=key: f"{key}: {m}", **tol)


def _grads_close(actual: dict, expected: dict) -> None:
    """fp32 gradients summed over ~100 slots in another order (and from a target rounded differently by EP/FSDP):
    compared to 1e-4 of each tensor's largest entry — a lost factor, row or share would be off by O(1)."""
    assert actual.keys() == expected.keys() and len(expected) > 5
    for key, value in expected.items():
        atol = 1e-4 * float(value.abs().max())
        torch.testing.assert_close(actual[key], value, rtol=1e-4, atol=atol, msg=lambda m, key=key: f"{key}: {m}")


def _adam_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 5
    for idx, state in expected.items():
        assert torch.equal(actual[idx]["step"], state["step"])
        for name in ("exp_avg", "exp_avg_sq"):  # gradient moments: compared as the gradients are
            value = state[name]
            atol = 1e-4 * float(value.abs().max())
            torch.testing.assert_close(actual[idx][name], value, rtol=2e-4, atol=atol, msg=f"{idx} {name}")


# Updated weights after AdamW steps of lr 1e-3: Adam's m/√v turns a gradient entry that is mostly cancellation (fp32
# sums over the slots in another order) into up to a whole lr-sized step, so the weights are compared to lr/20.
TOL = {"rtol": 1e-4, "atol": 5e-5}


def test_sp2_fit_equals_the_one_rank_fit_step_by_step(runs):
    r0, r1 = runs["sp2"]
    (one,) = runs["one"]
    # Both ranks of the group train on the 1-rank run's rows, in its order.
    assert r0["seen"] == r1["seen"] == one["seen"] and len(one["seen"]) == STEPS
    assert r0["global_step"] == one["global_step"] == STEPS
    # The logged loss is the group's (sum of the shares), the same on both ranks, and equals the 1-rank loss.
    assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6)
    assert r0["losses"] == pytest.approx(one["losses"], rel=1e-4)
    # Each rank backpropagated its share of the group's loss: both non-trivial, adding up to it.
    assert r0["sp"] == 2 and one["sp"] == 1
    for a, b, total in zip(r0["shares"], r1["shares"], r0["losses"]):
        assert a + b == pytest.approx(total, rel=1e-5) and 0.2 * total < a < 0.8 * total
    assert len(set(one["losses"])) == STEPS  # different rows, different losses
    for step in range(STEPS):  # gradients after the SP reduction: Σ over the group == the whole sequence's
        _close(r0["grads"][step], r1["grads"][step], rtol=0, atol=0)
        _grads_close(r0["grads"][step], one["grads"][step])
    _close(r0["draft"], r1["draft"], rtol=0, atol=0)  # the replicas never diverge
    _close(r0["draft"], one["draft"], **TOL)
    _adam_close(r0["optimizer"], one["optimizer"])
    # Validation after the last step: the group's loss (mean over the world of the group sums) and the acceptance
    # metrics from counts summed over all ranks (disjoint slots within a group) are the 1-rank values.
    assert r0["val"] == r1["val"] and one["val"] is not None
    assert r0["val"] == pytest.approx(one["val"], rel=1e-4)


def test_sp2_checkpoint_resumes_at_sp1_on_one_rank(runs, golden_dir):
    resumed = _fit(golden_dir, _data(), runs["tmp"] / "sp2_to_1", 1, 1, ckpt_path=runs["tmp"] / "sp2" / "step=2.ckpt")
    (one,) = runs["one"]
    (r,) = resumed
    assert r["seen"] == one["seen"][EVERY:] and r["global_step"] == STEPS
    assert r["losses"] == pytest.approx(one["losses"][EVERY:], rel=1e-4)
    _close(r["draft"], one["draft"], **TOL)
    _adam_close(r["optimizer"], one["optimizer"])


def test_sp1_checkpoint_resumes_at_sp2_on_two_ranks(runs, golden_dir):
    resumed = _fit(golden_dir, _data(), runs["tmp"] / "1_to_sp2", 2, 2, ckpt_path=runs["tmp"] / "one" / "step=2.ckpt")
    (one,) = runs["one"]
    for r in resumed:
        assert r["seen"] == one["seen"][EVERY:] and r["global_step"] == STEPS
        assert r["losses"] == pytest.approx(one["losses"][EVERY:], rel=1e-4)
        _close(r["draft"], one["draft"], **TOL)
        _adam_close(r["optimizer"], one["optimizer"])


def test_sp2_checkpoint_resumes_data_parallel_on_the_rows_the_sampler_says(runs, golden_dir):
    ckpt = runs["tmp"] / "sp2" / "step=2.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    assert saved["IndexedChatData"]["train_position"]["consumed"] == EVERY  # 2 steps × 1 row × 1 replica
    resumed = _fit(golden_dir, _data(), runs["tmp"] / "sp2_to_dp2", 2, 1, ckpt_path=ckpt)
    order = [i for (i,) in runs["one"][0]["seen"]]  # the world's order, one row per step
    # a micro-batch is now 2 rows over the world: the first resumed step is rows 2, 3 of the order
    assert [r["seen"][0] for r in resumed] == [[order[2]], [order[3]]]
    assert all(r["global_step"] == STEPS and len(r["seen"]) == STEPS - EVERY for r in resumed)
    _close(resumed[0]["draft"], resumed[1]["draft"], rtol=0, atol=0)
    # The draft and AdamW state were loaded: the step count continues from the checkpoint's.
    state = resumed[0]["optimizer"]
    assert all(int(s["step"]) == STEPS for s in state.values())
    # The draft was loaded: rank 0's first resumed row is the 1-rank run's step-3 row, on the same weights.
    assert resumed[0]["losses"][0] == pytest.approx(runs["one"][0]["losses"][EVERY], rel=1e-4)
