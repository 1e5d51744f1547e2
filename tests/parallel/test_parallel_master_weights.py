"""fp32 master weights of a bf16 draft in both placements, both families, on 2 forked gloo ranks: the replicated draft
(bf16 parameters, :class:`MasterWeights` over fp32 copies) and the FSDP2-sharded one (fp32 shards, bf16 gathers,
fp32 gradient reduction: ``shard_draft(..., compute_dtype=bf16)``) compute the same bf16 step and keep the same fp32
masters; the sharded one's parameters and AdamW states are fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from eagle_helpers import eagle_module
from torch.distributed.device_mesh import init_device_mesh

from lightning_eagle.parallel.dense_shard import is_sharded, shard_draft
from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.run_settings import TargetSettings
from lightning_eagle.training.dspark_anchors import anchor_generator
from lightning_eagle.training.dspark_module import DSparkModule
from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings
from lightning_eagle.training.master_weights import MasterWeights

pytestmark = pytest.mark.multiprocess
STEPS, LR = 3, 1e-3


def _module(family: str):
    if family == "dspark":
        target = TargetSettings(path="quickstart", aux_layer_ids=(1, 3, 4), dtype="float32")
        draft = DSparkDraftSettings(preset="k3-tiny", block_chunk=None, dtype="bfloat16")
        module = DSparkModule(target, draft, DSparkObjectiveSettings(num_anchors=12))
        module.configure_model()
        return module
    module = eagle_module(target="quickstart", aux_layer_ids=[1, 3, 5], target_dtype="float32", ttt_steps=2,
                          draft={"intermediate_size": 64}, draft_dtype="bfloat16")  # fmt: skip
    module.configure_model()
    return module


def _loss(module, family: str, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5 + rank)  # each rank its own rows
    ids = torch.randint(0, 300, (2, 40), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["loss_mask"][:, :8] = 0
    if family == "dspark":
        return module.shared_step(batch, anchor_generator(0, 0, rank))[0].loss
    return module.shared_step(batch).loss


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)


def _rank(rank: int, world: int, family: str) -> dict:
    torch.set_num_threads(1)
    replicated, sharded = _module(family), _module(family)  # the same bf16 init on every rank
    shard_draft(sharded.draft, init_device_mesh("cpu", (world,)), compute_dtype=torch.bfloat16)
    trained = [p for p in replicated.draft.parameters() if p.requires_grad]
    masters = MasterWeights(trained, _adamw)
    adamw = _adamw([p for p in sharded.draft.parameters() if p.requires_grad])
    out = {"losses": [], "dtypes": set()}
    for _ in range(STEPS):
        losses = []
        for module, optimizer in ((replicated, masters), (sharded, adamw)):
            optimizer.zero_grad()
            loss = _loss(module, family, rank)
            loss.backward()
            losses.append(float(loss))
            if module is replicated:  # what the strategy's gradient sync does for a replicated draft
                for p in trained:
                    if p.grad is not None:
                        total = p.grad.float()
                        dist.all_reduce(total)
                        p.grad.copy_(total / world)
            optimizer.step()
        out["losses"].append(losses)
    out["dtypes"] = {str(p.dtype) for p in sharded.draft.parameters() if p.requires_grad}
    out["sharded"] = all(is_sharded(p) for p in sharded.draft.parameters() if p.requires_grad)
    out["state_dtypes"] = {str(v.dtype) for s in adamw.state.values() for k, v in s.items() if k != "step"}
    out["replicated_dtypes"] = {str(p.dtype) for p in trained}
    names = [n for n, p in replicated.draft.named_parameters() if p.requires_grad]
    out["masters"] = dict(zip(names, (m.detach() for m in masters.masters)))
    out["shards"] = {n: p.full_tensor() for n, p in sharded.draft.named_parameters() if p.requires_grad}
    return out


@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_bf16_draft_keeps_fp32_masters_replicated_and_sharded_alike(family):
    import torch._dynamo  # noqa: F401 - imported once here instead of in every forked rank

    for rank, out in enumerate(launch_local(_rank, 2, family, timeout_s=300)):
        assert out["sharded"] and out["dtypes"] == {"torch.float32"}, out["dtypes"]
        assert out["state_dtypes"] == {"torch.float32"} and out["replicated_dtypes"] == {"torch.bfloat16"}
        for replicated, sharded in out["losses"]:  # both compute in bf16 from the same rounded weights
            assert abs(replicated - sharded) <= 2e-2 * abs(replicated), out["losses"]
        moved = 0
        for name, master in out["masters"].items():
            shard = out["shards"][name]
            torch.testing.assert_close(shard, master, atol=2e-4, rtol=2e-2, msg=f"rank {rank}: {name}")
            moved += int(name.endswith("norm.weight") and bool((master != 1).any()))
        assert moved > 0  # norm gains move by ~lr per step in the masters (never in pure bf16 at this lr)


def _partition_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same replicated parameters everywhere
    shapes = [(64, 32), (32,), (300, 8), (5,), (16, 16)]
    whole = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    parted = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    ones = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    full, zero = MasterWeights(whole, _adamw), MasterWeights(parted, _adamw, group=dist.group.WORLD)
    for step in range(STEPS):
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(step * 10 + i)).bfloat16()
                 for i, s in enumerate(shapes)]  # fmt: skip
        for params in (whole, parted):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        full.step(), zero.step()
    saved, whole_state = zero.state_dict(), copy.deepcopy(full.state_dict())  # the first: a collective
    after = [p.detach().clone() for p in whole]
    resumed = MasterWeights(ones, _adamw, group=dist.group.WORLD)
    resumed.load_state_dict(copy.deepcopy(full.state_dict()))  # a whole state loads into a partitioned optimizer
    for opt, params in ((full, whole), (resumed, ones)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return {"owned": zero.owned, "held": sum(m.numel() for m in zero.masters), "saved": saved,
            "whole_state": whole_state, "parted": parted, "after": after, "whole": whole, "ones": ones}  # fmt: skip


def test_partitioned_masters_step_save_and_resume_like_whole_ones():
    outs = launch_local(_partition_rank, 2, timeout_s=300)
    assert sorted(outs[0]["owned"] + outs[1]["owned"]) == list(range(5)) and outs[0]["owned"] and outs[1]["owned"]
    total = 64 * 32 + 32 + 300 * 8 + 5 + 16 * 16
    assert all(out["held"] < total for out in outs)  # each rank holds only its part of the fp32 masters
    for rank, out in enumerate(outs):
        for a, b in zip(out["parted"], out["after"]):  # each rank's own part stepped, the rest broadcast
            assert torch.equal(a, b), f"rank {rank}"
        for a, b in zip(out["ones"], out["whole"]):  # partitioned + resumed from a whole state == whole, exactly
            assert torch.equal(a, b), f"rank {rank}"
    saved, whole = outs[0]["saved"], outs[0]["whole_state"]
    assert outs[1]["saved"] == {}
    assert saved["param_groups"] == whole["param_groups"] and saved["state"].keys() == whole["state"].keys()
    for a, b in zip(saved["masters"], whole["masters"], strict=True):
        assert torch.equal(a, b)
    for i, state in whole["state"].items():
        for key, value in state.items():
            assert torch.equal(saved["state"][i][key], value), (i, key)


# ---- through Lightning: a 2-rank replicated bf16 fit checkpoints its partitioned masters and resumes exactly -------
def _fit(out, ckpt_path=None, max_steps=2):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_eagle.data import ChatDataModule
    from lightning_eagle.parallel.strategy import ExpertParallelStrategy

    module = eagle_module(target="quickstart", aux_layer_ids=[1, 3, 5], target_dtype="float32", ttt_steps=2,
                          draft={"intermediate_size": 64}, draft_dtype="bfloat16")  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=max_steps, limit_val_batches=0, num_sanity_val_steps=0,
        strategy=ExpertParallelStrategy(expert_parallel_size=2, start_method="fork"), logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
        callbacks=[ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=1, save_top_k=-1)],
    )  # fmt: skip
    data = {"max_length": 96, "batch_size": 1, "thinking_effort": None, "draft_vocab_size": 320, "use_cache": False}
    trainer.fit(module, ChatDataModule(**data), ckpt_path=ckpt_path)


def test_a_replicated_bf16_fit_saves_whole_masters_and_resumes_exactly(tmp_path):
    import torch._dynamo  # noqa: F401 - imported once here instead of in every forked rank

    _fit(tmp_path / "run")
    _fit(tmp_path / "resumed", ckpt_path=tmp_path / "run" / "step=1.ckpt")
    saved = torch.load(tmp_path / "run" / "step=2.ckpt", map_location="cpu", weights_only=False)
    resumed = torch.load(tmp_path / "resumed" / "step=2.ckpt", map_location="cpu", weights_only=False)
    assert saved["draft_master_weights"] is True
    masters = saved["optimizer_states"][0]["masters"]
    trained = {k: v for k, v in saved["state_dict"].items() if v.is_floating_point() and "embed_tokens" not in k}
    assert len(masters) == len(trained) and all(m.dtype == torch.float32 and m.numel() for m in masters)
    for name, value in saved["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], value), name
    for a, b in zip(resumed["optimizer_states"][0]["masters"], masters, strict=True):
        assert torch.equal(a, b)
