"""bf16 drafts on fp32 master weights train like fp32 ones and pure bf16 (the negative control) does not, for both
families: each draft of the tiny target is trained three ways from the same init on the same batches at the K3
configs' learning rate (6e-4) through its module's own step and ``configure_optimizers`` (``benchmarks/
mixed_precision.py`` is the whole-``fit`` form, with the numbers docs/training.md quotes)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from eagle_helpers import grouped_settings

from lightning_eagle import Eagle3Module
from lightning_eagle.run_settings import OptimizationSettings, TargetSettings
from lightning_eagle.training.dspark_anchors import anchor_generator
from lightning_eagle.training.dspark_module import DSparkModule
from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings
from lightning_eagle.training.master_weights import MasterWeights

STEPS, LR = 150, 6e-4
RECIPES = {"fp32": ("float32", True), "bf16-master": ("bfloat16", True), "bf16-pure": ("bfloat16", False)}


def _module(family: str, dtype: str, master_weights: bool):
    optimization = OptimizationSettings(lr=LR, warmup_ratio=0.0, min_lr_ratio=1.0)  # a constant lr: no trainer
    if family == "dspark":
        target = TargetSettings(path="quickstart", aux_layer_ids=(1, 3, 4), dtype="float32")
        draft = DSparkDraftSettings(preset="k3-tiny", block_chunk=None, dtype=dtype, master_weights=master_weights)
        module = DSparkModule(target, draft, DSparkObjectiveSettings(num_anchors=16), optimization)
    else:
        groups = grouped_settings({"target": "quickstart", "aux_layer_ids": [1, 3, 5], "target_dtype": "float32",
                                   "ttt_steps": 2, "draft_dtype": dtype}, {"intermediate_size": 64})  # fmt: skip
        groups["draft"] = dataclasses.replace(groups["draft"], master_weights=master_weights)
        module = Eagle3Module(**{**groups, "optimization": optimization})
    module.configure_model()
    return module


def _batches(n: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 300, (2, 48), generator=g)
        mask = torch.ones_like(ids)
        mask[:, :6] = 0
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask})
    return out


def _train(family: str, recipe: str) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the tiny models: one thread is fastest, and never oversubscribed
    module = _module(family, *RECIPES[recipe])
    optimizer = module.configure_optimizers()["optimizer"]
    initial = {n: p.detach().float().clone() for n, p in module.draft.named_parameters() if p.requires_grad}
    losses, batches = [], _batches()
    for step in range(STEPS):
        batch = batches[step % len(batches)]
        out = (
            module.shared_step(batch, anchor_generator(0, step, 0)) if family == "dspark" else module.shared_step(batch)
        )
        loss = (out[0] if family == "dspark" else out).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    moved = {n: p.detach().float() != initial[n] for n, p in module.draft.named_parameters() if n in initial}
    norms = [n for n in moved if "norm" in n and n.endswith("weight")]
    params = dict(module.draft.named_parameters())
    tail = losses[-STEPS // 5 :]
    return {"optimizer": optimizer, "loss": sum(tail) / len(tail), "first": losses[0],
            "gains_moved": float(torch.cat([moved[n].flatten() for n in norms]).float().mean()),
            "gains": torch.cat([params[n].detach().float().flatten() for n in norms])}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_bf16_on_fp32_masters_tracks_fp32_and_pure_bf16_does_not(family):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = {recipe: _train(family, recipe) for recipe in RECIPES}
    fp32, master, pure = runs["fp32"], runs["bf16-master"], runs["bf16-pure"]
    assert isinstance(master["optimizer"], MasterWeights) and not isinstance(pure["optimizer"], MasterWeights)
    assert fp32["loss"] < 0.9 * fp32["first"]  # it learns: the comparison is of training, not of noise
    gap = {name: abs(run["loss"] - fp32["loss"]) / fp32["loss"] for name, run in runs.items()}
    assert gap["bf16-master"] < 0.02, gap
    assert master["gains_moved"] > 0.5 and fp32["gains_moved"] == 1.0, (master, fp32)
    # the negative control: not one bf16 norm gain moves at lr 6e-4, so its gains are as far from fp32's as fp32's
    # moved, where the masters' are within bf16 rounding of them
    assert pure["gains_moved"] == 0.0, pure
    apart = {name: float((run["gains"] - fp32["gains"]).abs().max()) for name, run in runs.items()}
    assert apart["bf16-master"] < 0.01 < apart["bf16-pure"], apart
    assert any("model.draft.master_weights=false trains" in str(w.message) for w in caught)  # warned by name
