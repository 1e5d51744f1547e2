"""``model.draft.shard`` for the DSpark drafter: its units FSDP2-sharded over 2 forked gloo ranks give the replicated
drafter's step (loss and averaged gradients, both loss backends, whose heads are read outside any unit call), its
inference calls (context cache, block proposal, Markov sampling), and through Lightning the same trained drafter,
validation (real block decoding included), checkpoints, resume and export as a replicated 2-rank run."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh

from lightning_eagle.commands.export import main as export_main
from lightning_eagle.data import ChatDataModule
from lightning_eagle.draft.dspark import DSparkContextCache
from lightning_eagle.draft.dspark_export import dspark_drafter_from_checkpoint, dspark_export_state
from lightning_eagle.inference.callback import AcceptanceCallback
from lightning_eagle.parallel.dense_shard import dense_bytes_held, is_sharded, shard_draft, with_full_parameters
from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.parallel.strategy import ExpertParallelStrategy
from lightning_eagle.run_settings import TargetSettings
from lightning_eagle.training.dspark_anchors import anchor_generator
from lightning_eagle.training.dspark_module import DSparkModule
from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings
from lightning_eagle.training.export_callback import ExportDraftCallback

pytestmark = pytest.mark.multiprocess

TINY_TARGET = TargetSettings(path="quickstart", aux_layer_ids=(1, 3, 4), dtype="float32")


def _module(backend: str, block_chunk: int | None = 5) -> DSparkModule:
    objective = DSparkObjectiveSettings(num_anchors=12, loss_backend=backend, loss_chunk=7)
    module = DSparkModule(TINY_TARGET, DSparkDraftSettings(preset="k3-tiny", block_chunk=block_chunk), objective)
    module.configure_model()
    return module


def _batch(rank: int, B: int = 2, T: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3 + rank)  # each rank its own rows: the gradients must be averaged to agree
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[:, :9] = 0
    loss_mask[1, 30 - 5 * rank :] = 0
    return {"input_ids": torch.randint(0, 300, (B, T), generator=g), "attention_mask": torch.ones(B, T).long(),
            "loss_mask": loss_mask}  # fmt: skip


def _whole(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """A sharded gradient gathered (FSDP averaged it), a replicated one averaged over the ranks here."""
    if is_sharded(tensor):
        return tensor.full_tensor()
    total = tensor.clone()
    dist.all_reduce(total)
    return total / world


def _step_rank(rank: int, world: int, backend: str) -> dict:
    torch.set_num_threads(1)
    replicated, sharded = _module(backend), _module(backend)  # the same init (init_seed) on every rank
    shard_draft(sharded.draft, init_device_mesh("cpu", (world,)))
    out = {"sharded": all(is_sharded(p) for p in sharded.draft.parameters())}
    batch = _batch(rank)
    for name, module in (("replicated", replicated), ("sharded", sharded)):
        with torch.no_grad():  # the validation path: heads gathered and freed with no backward
            out[f"{name}_eval"] = module.shared_step(batch, anchor_generator(0, 1, rank))[0].loss
        loss = module.shared_step(batch, anchor_generator(0, 0, rank))[0]
        loss.loss.backward()
        out[f"{name}_loss"], out[f"{name}_tv"] = loss.loss.detach(), loss.tv
        out[f"{name}_grads"] = {n: _whole(p.grad, world) for n, p in module.draft.named_parameters()}
        out[f"{name}_block"] = _propose(module, batch)
    return out


@torch.no_grad()
def _propose(module: DSparkModule, batch: dict[str, torch.Tensor]):
    """One greedy block after the first 20 tokens: the drafter's inference calls (context latents, the layers, the
    Markov bias), each of which an FSDP2 unit must gather for."""
    context, _, _ = module.source.features(batch)
    drafter, embedding = module.draft, module.embedding()
    cache = DSparkContextCache(drafter)
    cache.append(context[:, :20])
    slots = drafter.propose_block(cache, batch["input_ids"][:, 20], lambda ids: embedding[ids])
    block = drafter.sample_block(slots, batch["input_ids"][:, 20], module.source.model.lm_head)
    return slots, block.tokens, block.logits


@pytest.mark.parametrize("backend", ["plain", "chunked"])
def test_a_sharded_drafter_steps_and_proposes_like_the_replicated_one(backend):
    import torch._dynamo  # noqa: F401 - imported once here instead of in every forked rank

    for rank, out in enumerate(launch_local(_step_rank, 2, backend, timeout_s=300)):
        assert out["sharded"]
        close = dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["sharded_eval"], out["replicated_eval"], **close)
        torch.testing.assert_close(out["sharded_loss"], out["replicated_loss"], **close)
        torch.testing.assert_close(out["sharded_tv"], out["replicated_tv"], **close)
        replicated = out["replicated_grads"]
        assert any(g.abs().sum() > 0 for g in replicated.values())
        assert out["sharded_grads"].keys() == replicated.keys()
        for name, grad in out["sharded_grads"].items():  # markov_head.* and confidence_head.* included
            torch.testing.assert_close(grad, replicated[name], rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {name}")
        for got, want in zip(out["sharded_block"], out["replicated_block"], strict=True):
            torch.testing.assert_close(got, want, **close)


def _gathers_rank(rank: int, world: int) -> list[int]:
    torch.set_num_threads(1)
    counts, all_gather = [], dist.all_gather_single  # what FSDP2's all-gather of one unit calls (torch 2.13)

    def counted(*args, **kwargs):
        counts[-1] += 1
        return all_gather(*args, **kwargs)

    dist.all_gather_single = counted
    for block_chunk in (None, 5, 2):  # 1, 3 and 6 attention calls for 12 anchors
        module = _module("chunked", block_chunk)
        shard_draft(module.draft, init_device_mesh("cpu", (world,)))
        counts.append(0)
        module.shared_step(_batch(rank), anchor_generator(0, 0, rank))[0].loss.backward()
    return counts


def test_a_sharded_layer_is_gathered_per_call_not_per_anchor_chunk():
    for counts in launch_local(_gathers_rank, 2, timeout_s=300):
        assert counts[0] > 0 and counts == [counts[0]] * 3, counts


# ---- through Lightning: fit, checkpoints, resume, export ----------------------------------------------------------
STEPS = 2
DATA = {"max_length": 96, "batch_size": 2, "thinking_effort": None, "use_cache": False}


def _sgd(params):
    # Linear in the gradient: a different summation order stays at float-noise level (Adam would amplify it).
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


class _Record(pl.Callback):
    """One intra-op thread per rank; records on rank 0 whether the drafter's parameters are DTensors and the
    validation metrics (the objective's, and real block decoding's ``val/tau_real``, run by every rank)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer, pl_module, stage):
        torch.set_num_threads(1)

    def on_validation_end(self, trainer, module):
        if trainer.global_rank == 0:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            (self.out / "val.json").write_text(json.dumps(metrics))

    def on_train_end(self, trainer, module):
        if trainer.global_rank == 0:
            (self.out / "sharded.txt").write_text(str(all(is_sharded(p) for p in module.draft.parameters())))
            (self.out / "bytes.txt").write_text(str(dense_bytes_held(module.draft)))  # this rank's parameter bytes


def _dspark_module(shard: bool) -> DSparkModule:
    return DSparkModule(
        TINY_TARGET, DSparkDraftSettings(preset="k3-tiny", shard=shard),
        DSparkObjectiveSettings(num_anchors=16, loss_backend="chunked", loss_chunk=64), optimizer=_sgd,
    )  # fmt: skip


def _fit(out: Path, devices: int, shard: bool, max_steps: int = STEPS, ckpt_path=None, dcp: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    module = _dspark_module(shard)
    every_step = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    export = ExportDraftCallback(out_dir=str(out / "draft"), use_best=False, dtype="float32")
    decode = AcceptanceCallback(num_prompts=2, max_new_tokens=8)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, max_steps=max_steps, gradient_clip_val=1.0, limit_val_batches=1,
        val_check_interval=STEPS,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        strategy=ExpertParallelStrategy(expert_parallel_size=devices, start_method="fork",
                                        save_distributed_checkpoint=dcp),
        enable_model_summary=False, default_root_dir=str(out), callbacks=[_Record(out), every_step, export, decode],
    )  # fmt: skip
    trainer.fit(module, ChatDataModule(**DATA), ckpt_path=ckpt_path)


def _drafter(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("draft.")}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name in want:  # whole tensors, whichever layout wrote them
        assert not is_sharded(got[name])
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch._dynamo  # noqa: F401 - imported once here instead of in every forked rank

    tmp = tmp_path_factory.mktemp("dspark_shard")
    _fit(tmp / "replicated", 2, shard=False)
    _fit(tmp / "sharded", 2, shard=True)
    _fit(tmp / "resumed", 2, shard=True, ckpt_path=tmp / "sharded" / "step=1.ckpt")
    _fit(tmp / "dcp", 2, shard=True, dcp=True)  # checkpoints as DCP folders, one file per rank
    _fit(tmp / "dcp_resumed", 2, shard=True, ckpt_path=tmp / "dcp" / "step=1.ckpt", dcp=True)
    return tmp


@pytest.mark.slow
def test_a_sharded_dspark_fit_trains_checkpoints_and_exports_the_replicated_drafter(runs):
    assert [(runs / name / "sharded.txt").read_text() for name in ("sharded", "replicated")] == ["True", "False"]
    first, last = _drafter(runs / "sharded" / "step=1.ckpt"), _drafter(runs / "sharded" / f"step={STEPS}.ckpt")
    assert any(not torch.equal(first[k], last[k]) for k in first)  # it trained
    sharded_val, replicated_val = (json.loads((runs / n / "val.json").read_text()) for n in ("sharded", "replicated"))
    assert {"val/loss", "val/tau_sim", "val/tau_real"} <= set(replicated_val)
    assert sharded_val == pytest.approx(replicated_val, rel=1e-5, abs=1e-6)
    for step in (1, STEPS):
        _assert_same(_drafter(runs / "sharded" / f"step={step}.ckpt"), _drafter(runs / "replicated" /
                                                                               f"step={step}.ckpt"))  # fmt: skip
    sharded = load_file(str(runs / "sharded" / "draft" / "model.safetensors"))
    _assert_same(sharded, load_file(str(runs / "replicated" / "draft" / "model.safetensors")))
    last = torch.load(runs / "sharded" / f"step={STEPS}.ckpt", map_location="cpu", weights_only=False)
    _assert_same(dspark_export_state(dspark_drafter_from_checkpoint(last), torch.float32), sharded)  # cli.py export's
    held = [int((runs / n / "bytes.txt").read_text()) for n in ("sharded", "replicated")]
    assert held[0] <= 0.55 * held[1]  # a rank holds its half of the drafter (dim-0 shards, a row or two uneven)


@pytest.mark.slow
def test_a_sharded_dspark_checkpoint_resumes_to_the_uninterrupted_drafter(runs):
    _assert_same(_drafter(runs / "resumed" / f"step={STEPS}.ckpt"), _drafter(runs / "sharded" / f"step={STEPS}.ckpt"))
    resumed = load_file(str(runs / "resumed" / "draft" / "model.safetensors"))
    _assert_same(resumed, load_file(str(runs / "sharded" / "draft" / "model.safetensors")))


@pytest.mark.slow
def test_a_sharded_dspark_runs_dcp_checkpoints_resume_and_export_the_same_drafter(runs, tmp_path):
    fit_export = load_file(str(runs / "sharded" / "draft" / "model.safetensors"))
    for name in ("dcp", "dcp_resumed"):
        assert (runs / name / f"step={STEPS}.ckpt" / ".metadata").is_file()
        _assert_same(load_file(str(runs / name / "draft" / "model.safetensors")), fit_export)
    export_main([str(runs / "dcp" / f"step={STEPS}.ckpt"), str(tmp_path / "exported"), "--dtype", "float32"])
    _assert_same(load_file(str(tmp_path / "exported" / "model.safetensors")), fit_export)  # the folder says DSpark


# Under the fork launcher a worker's error reaches the caller as ProcessRaisedException carrying the message.
@pytest.mark.slow
def test_a_sharded_dspark_checkpoint_refuses_a_replicated_resume(runs):
    with pytest.raises(Exception, match="written with model.draft.shard=True and this run has model.draft.shard=False"):
        _fit(runs / "refused", 2, shard=False, ckpt_path=runs / "sharded" / "step=1.ckpt")


def test_dspark_shard_needs_more_than_one_rank_and_is_refused_before_any_weight_is_read(tmp_path):
    with pytest.raises(Exception, match="model.draft.shard=true shards the draft over ranks"):
        _fit(tmp_path / "ep", 1, shard=True, max_steps=1)
    module = _dspark_module(shard=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                         default_root_dir=str(tmp_path / "single"))  # fmt: skip
    with pytest.raises(ValueError, match=r"model.draft.shard=true shards the draft over ranks.*\(got world size 1\)"):
        trainer.fit(module, ChatDataModule(**DATA))
    assert module.source is None and module.draft is None  # refused in setup: neither target nor drafter was built


def _unregistered_rank(rank: int, world: int) -> str:
    from torch.distributed.fsdp import fully_shard

    unit = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (world,)))
    try:
        with_full_parameters([unit], lambda x: unit.weight @ x, torch.ones(4))
    except ValueError as err:
        return str(err)
    return "no error"


def test_full_parameters_of_a_unit_sharded_elsewhere_are_refused_by_name():
    (message,) = launch_local(_unregistered_rank, 1, timeout_s=120)
    assert "['FSDPLinear'] were FSDP-sharded without shard_draft" in message
