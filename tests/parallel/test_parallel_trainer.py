"""ExpertParallelStrategy inside a real ``Trainer`` (2 forked gloo ranks, the golden K3 target).

A small stand-in module drives the strategy exactly as ``Eagle3Module`` does: ``configure_model`` calls
``load_frozen_target`` (this rank's expert slice, the dispatcher), the "draft" is a linear map from the captured aux
states to the final hidden state, ``state_dict`` drops the target.

One 2-rank EP=2 epoch must equal one 1-rank epoch over the same samples (the sampler shards over the world, the
gradients are averaged), and its checkpoint must resume on one rank to the same state as an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.parallel.frozen_target import load_frozen_target
from lightning_eagle.parallel.shard import routed_expert_bytes
from lightning_eagle.parallel.strategy import ExpertParallelStrategy

pytestmark = pytest.mark.multiprocess

AUX_IDS = [1, 3, 4]
SEQ = 24


class StandInModule(L.LightningModule):
    def __init__(self, target_path: str, out_dir: str) -> None:
        super().__init__()
        # Declared target (HasTargetSpec): the strategy gates it before any process starts.
        self.target_spec = TargetSpec.from_checkpoint(target_path, dtype="float32", aux_layer_ids=AUX_IDS)
        self.out_dir = out_dir
        self.strict_loading = False  # the checkpoint holds only the draft
        gen = torch.Generator().manual_seed(0)
        self.draft = nn.Linear(3 * 64, 64)
        with torch.no_grad():
            self.draft.weight.copy_(torch.randn(self.draft.weight.shape, generator=gen) * 0.05)
            self.draft.bias.zero_()
        self.target = None
        self.seen: list[int] = []

    def setup(self, stage: str) -> None:
        # One thread per rank: two threads per process on a contended 2-core runner is 10x slower, not faster.
        torch.set_num_threads(1)

    def configure_model(self) -> None:
        if self.target is None:  # idempotent: Lightning calls it once per stage
            self.target = load_frozen_target(self, self.target_spec)

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        return {k: v for k, v in state.items() if not k.startswith("target.")}

    def training_step(self, batch, batch_idx):
        index, ids = batch
        self.seen.extend(index.tolist())
        cap = self.target.capture(ids, None, AUX_IDS)
        return F.mse_loss(self.draft(cap.aux_hidden_states), cap.final_hidden)

    def configure_optimizers(self):
        # SGD is linear in the gradient, so a sum-instead-of-mean reduction would show (Adam would hide it);
        # momentum gives the optimizer a state that the resume must restore.
        return torch.optim.SGD(self.draft.parameters(), lr=0.5, momentum=0.9)

    def on_train_end(self) -> None:
        rank = self.trainer.global_rank
        report = {
            "world": self.trainer.world_size,
            "seen": self.seen,
            "draft": {k: v.clone() for k, v in self.draft.state_dict().items()},
            "optimizer": self.trainer.optimizers[0].state_dict()["state"],
            "experts": [(m.experts.start, m.experts.count) for m in self._moe()],
            "expert_bytes": routed_expert_bytes(self.target),
            "dispatch": sorted({type(m.dispatch).__name__ for m in self._moe()}),
            "global_step": self.trainer.global_step,
        }
        torch.save(report, Path(self.out_dir) / f"rank{rank}.pt")

    def _moe(self):
        return [layer.block_sparse_moe for layer in self.target.model.layers[1:]]


def _samples(golden_dir: Path) -> list[tuple[int, torch.Tensor]]:
    ids = load_file(str(golden_dir / "target" / "inputs.safetensors"))["input_ids"]
    rows = [ids[0, :SEQ], ids[0, SEQ : 2 * SEQ], ids[0, 2 * SEQ : 3 * SEQ], ids[1, :SEQ]]  # all valid tokens
    return list(enumerate(rows))


def _fit(golden_dir, out_dir, devices, batch_size, epochs, ckpt_path=None):
    """Fit the stand-in; checkpoints after every epoch go to ``out_dir/epoch=N.ckpt``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    module = StandInModule(str(golden_dir / "target"), str(out_dir))
    checkpoint = ModelCheckpoint(dirpath=out_dir, filename="{epoch}", save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ExpertParallelStrategy(expert_parallel_size=devices, start_method="fork"),
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint],
    )
    trainer.fit(module, DataLoader(_samples(golden_dir), batch_size=batch_size), ckpt_path=ckpt_path)
    reports = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(devices)]
    reports[0]["main_process_draft"] = {k: v.clone() for k, v in module.draft.state_dict().items()}
    return reports


@pytest.fixture(scope="module")
def runs(golden_dir, tmp_path_factory):
    import torch._dynamo  # noqa: F401 - imported once here instead of in every forked rank

    tmp = tmp_path_factory.mktemp("ep_trainer")
    # 4 samples: two ranks × batch 1 and one rank × batch 2 both take steps on {0, 1} then {2, 3}.
    ep2 = _fit(golden_dir, tmp / "ep2", devices=2, batch_size=1, epochs=1)
    one = _fit(golden_dir, tmp / "one", devices=1, batch_size=2, epochs=2)
    ep2_ckpt = tmp / "ep2" / "epoch=0.ckpt"
    resumed = _fit(golden_dir, tmp / "resumed", devices=1, batch_size=2, epochs=2, ckpt_path=ep2_ckpt)
    return {
        "ep2": ep2,
        "one": one,
        "resumed": resumed,
        "ep2_ckpt": ep2_ckpt,
        "one_epoch0": torch.load(tmp / "one" / "epoch=0.ckpt", weights_only=False),
    }


def test_each_rank_holds_half_of_the_experts_and_the_torch_dispatcher(runs):
    r0, r1 = runs["ep2"]
    (single,) = runs["one"]
    assert set(r0["experts"]) == {(0, 4)} and set(r1["experts"]) == {(4, 4)}
    assert set(single["experts"]) == {(0, 8)}
    assert r0["expert_bytes"] == r1["expert_bytes"] == single["expert_bytes"] // 2
    assert r0["dispatch"] == r1["dispatch"] == ["TorchExpertDispatcher"]
    assert single["dispatch"] == ["function"]  # world size 1: the local dispatch stays


def test_rank0_draft_returns_to_the_main_process(runs, golden_dir):
    r0 = runs["ep2"][0]
    initial = StandInModule(str(golden_dir / "target"), "").draft.state_dict()
    for key, value in r0["draft"].items():
        torch.testing.assert_close(r0["main_process_draft"][key], value, atol=0, rtol=0)
        assert not torch.equal(value, initial[key])  # it did train


def test_sampler_shards_over_the_whole_world(runs):
    r0, r1 = runs["ep2"]
    assert sorted(r0["seen"] + r1["seen"]) == [0, 1, 2, 3] and not set(r0["seen"]) & set(r1["seen"])


def test_two_ranks_ep2_equal_one_rank(runs):
    r0, r1 = runs["ep2"]
    for key in r0["draft"]:
        torch.testing.assert_close(r0["draft"][key], r1["draft"][key], atol=0, rtol=0)  # replicas never diverge
    # Rank 0 and rank 1 each saw one sample per step; averaged gradients == one rank's batch of both samples.
    ref = runs["one_epoch0"]["state_dict"]
    for key in r0["draft"]:
        torch.testing.assert_close(r0["draft"][key], ref[f"draft.{key}"], atol=1e-6, rtol=1e-5)


def test_checkpoint_holds_only_the_draft_and_resumes_on_one_rank(runs):
    ckpt = torch.load(runs["ep2_ckpt"], weights_only=False)
    assert sorted(ckpt["state_dict"]) == ["draft.bias", "draft.weight"]
    assert ckpt["global_step"] == 2
    (resumed,) = runs["resumed"]
    (single,) = runs["one"]
    assert resumed["global_step"] == single["global_step"] == 4
    for key in single["draft"]:
        torch.testing.assert_close(resumed["draft"][key], single["draft"][key], atol=1e-6, rtol=1e-5)
    assert single["optimizer"].keys() == resumed["optimizer"].keys() == {0, 1}
    for idx, state in single["optimizer"].items():
        torch.testing.assert_close(
            resumed["optimizer"][idx]["momentum_buffer"], state["momentum_buffer"], atol=1e-7, rtol=1e-5
        )


@pytest.mark.slow
def test_spawn_start_method_runs_the_same_fit(golden_dir, tmp_path, runs):
    """The spawn launcher (fresh interpreters, pickled trainer) reaches the same draft as the forked run."""
    out_dir = tmp_path / "spawn"
    out_dir.mkdir()
    module = StandInModule(str(golden_dir / "target"), str(out_dir))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ExpertParallelStrategy(expert_parallel_size=2, start_method="spawn"),
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(_samples(golden_dir), batch_size=1))
    r0 = torch.load(out_dir / "rank0.pt", weights_only=False)
    for key, value in runs["ep2"][0]["draft"].items():
        torch.testing.assert_close(r0["draft"][key], value, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(module.draft.weight, r0["draft"]["weight"])  # shipped back to the main process
