"""``draft_shard``: the draft's trained parameters, gradients and optimizer states FSDP2-sharded over 2 forked gloo
ranks train exactly like the replicated draft, checkpoint as one full file, resume, and refuse a resume into the other
layout (their optimizer states are laid out differently)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from eagle_helpers import eagle_module
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_eagle.data import ChatDataModule
from lightning_eagle.parallel.dense_shard import is_sharded
from lightning_eagle.parallel.strategy import ExpertParallelStrategy
from lightning_eagle.training.export_callback import ExportDraftCallback

pytestmark = pytest.mark.multiprocess

STEPS = 2
DATA = {"max_length": 128, "batch_size": 1, "thinking_effort": None, "draft_vocab_size": 320, "use_cache": False}


def _sgd(params):
    # Linear in the gradient: a different summation order stays at float-noise level (Adam would amplify it).
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


class Sharding(pl.Callback):
    """Records, on rank 0, whether the draft's trained parameters are DTensors."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer, pl_module, stage):
        torch.set_num_threads(1)

    def on_train_end(self, trainer, module):
        trained = [p for p in module.draft.parameters() if p.requires_grad]
        if trainer.global_rank == 0:
            (self.out / "sharded.txt").write_text(str(all(is_sharded(p) for p in trained)))


def _fit(golden_dir, out: Path, devices: int, shard: bool, max_steps: int = STEPS, ckpt_path=None):
    out.mkdir(parents=True, exist_ok=True)
    module = eagle_module(
        target=str(golden_dir / "target"), aux_layer_ids=[1, 3, 4], target_dtype="float32", ttt_steps=2,
        draft={"intermediate_size": 64}, draft_shard=shard, optimizer=_sgd,
    )  # fmt: skip
    every_step = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, max_steps=max_steps, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=ExpertParallelStrategy(expert_parallel_size=devices, start_method="fork"), logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
        callbacks=[Sharding(out), every_step, ExportDraftCallback(out_dir=str(out / "draft"), use_best=False)],
    )  # fmt: skip
    trainer.fit(module, ChatDataModule(**DATA), ckpt_path=ckpt_path)


def _draft(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("draft.")}


@pytest.fixture(scope="module")
def runs(golden_dir, tmp_path_factory):
    import torch._dynamo  # noqa: F401 - imported once here instead of in every forked rank

    tmp = tmp_path_factory.mktemp("draft_shard")
    _fit(golden_dir, tmp / "replicated", 2, shard=False)
    _fit(golden_dir, tmp / "sharded", 2, shard=True)
    _fit(golden_dir, tmp / "resumed", 2, shard=True, ckpt_path=tmp / "sharded" / "step=1.ckpt")
    return tmp


def test_sharded_draft_trains_like_the_replicated_one(runs):
    assert (runs / "sharded" / "sharded.txt").read_text() == "True"
    assert (runs / "replicated" / "sharded.txt").read_text() == "False"
    for step in (1, STEPS):
        sharded, replicated = _draft(runs / "sharded" / f"step={step}.ckpt"), _draft(runs / "replicated" /
                                                                                      f"step={step}.ckpt")  # fmt: skip
        assert sharded.keys() == replicated.keys()
        for name in sharded:  # the checkpoint holds full tensors, whichever layout wrote it
            assert not is_sharded(sharded[name])
            torch.testing.assert_close(sharded[name], replicated[name], atol=1e-6, rtol=1e-5, msg=name)


def test_a_sharded_drafts_fit_end_export_is_the_replicated_ones(runs):
    # the callback exports the current weights: a sharded draft's are gathered whole by every rank first
    sharded, replicated = (load_file(str(runs / n / "draft" / "model.safetensors")) for n in ("sharded", "replicated"))
    assert sharded.keys() == replicated.keys() and sharded
    for name in sharded:
        torch.testing.assert_close(sharded[name], replicated[name], atol=1e-6, rtol=1e-5, msg=name)


def test_sharded_checkpoint_resumes_to_the_uninterrupted_state(runs):
    resumed, full = _draft(runs / "resumed" / f"step={STEPS}.ckpt"), _draft(runs / "sharded" / f"step={STEPS}.ckpt")
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], atol=1e-6, rtol=1e-5, msg=name)


# Under the fork launcher a worker's error reaches the caller as ProcessRaisedException carrying the message.
def test_resuming_into_the_other_layout_is_refused(runs, golden_dir):
    with pytest.raises(Exception, match="written with model.draft.shard=True and this run has model.draft.shard=False"):
        _fit(golden_dir, runs / "refused", 1, shard=False, max_steps=STEPS, ckpt_path=runs / "sharded" / "step=1.ckpt")


def test_draft_shard_needs_more_than_one_rank(golden_dir, tmp_path):
    with pytest.raises(Exception, match="model.draft.shard=true shards the draft over ranks"):
        _fit(golden_dir, tmp_path, 1, shard=True, max_steps=1)
