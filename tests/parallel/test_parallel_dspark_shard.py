"""``model.draft.shard`` for the DSpark drafter: its units FSDP2-sharded over 2 forked gloo ranks give the replicated
drafter's step (loss and averaged gradients, both loss backends, whose heads are read outside any unit call), its
inference calls (context cache, block proposal, Markov sampling), and through Lightning the same trained drafter,
checkpoints, resume and export as a replicated 2-rank run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_eagle.draft.dspark import DSparkContextCache
from lightning_eagle.parallel.dense_shard import is_sharded, shard_draft
from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.run_settings import DSparkDraftSettings, DSparkObjectiveSettings, TargetSettings
from lightning_eagle.training.dspark_anchors import anchor_generator
from lightning_eagle.training.dspark_module import DSparkModule

pytestmark = pytest.mark.multiprocess

TINY_TARGET = TargetSettings(path="quickstart", aux_layer_ids=(1, 3, 4), dtype="float32")


def _module(backend: str) -> DSparkModule:
    objective = DSparkObjectiveSettings(num_anchors=12, loss_backend=backend, loss_chunk=7)
    module = DSparkModule(TINY_TARGET, DSparkDraftSettings(preset="k3-tiny"), objective)
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
