"""``ttt_loss(sequence_shard=...)`` — the unroll itself under draft sequence parallelism — equals the one-process
``ttt_loss``: the ranks' loss and per-step shares add up to its values, their counts to its counts, their gradients
to its gradients and their argmaxes tile its argmax; for both loss backends (plain: fp64-tight; chunked: its fp32
soft CE), both teacher sources, plain and checkpointed steps, the K3 (NoPE) and the rotary deepseek_mla layer, with
right padding and a length that is not a multiple of the group size."""

from __future__ import annotations

import pytest
import torch
from draft_helpers import tiny_batch, tiny_draft

from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.parallel.sequence_parallel import SequenceShard
from lightning_eagle.training.ttt import checkpointed_draft_step, draft_step, ttt_loss

K = 3
T = 11
STEPS = {"plain": draft_step, "checkpointed": checkpointed_draft_step}


def soft_ce64(logits, target_probs, position_mask):
    """``soft_cross_entropy`` without the fp32 cast, so that the plain comparison is fp64-tight."""
    per_position = -(target_probs.to(logits.dtype) * torch.log_softmax(logits, dim=-1)).sum(-1)
    mask = position_mask.to(torch.bool)
    return torch.where(mask, per_position, torch.zeros_like(per_position)).sum() / mask.sum().clamp_min(1)


# (architecture, loss backend, teacher source, step)
CASES = [
    ("k3", "plain", "target_logits", "plain"),
    ("k3", "plain", "final_hidden", "checkpointed"),
    ("k3", "chunked", "target_logits", "checkpointed"),
    ("k3", "chunked", "final_hidden", "plain"),
    ("deepseek_mla", "plain", "target_logits", "checkpointed"),
    ("deepseek_mla", "chunked", "final_hidden", "plain"),
]


def _setup():
    drafts = {
        "k3": tiny_draft(seed=0, dtype=torch.float64, draft_vocab_size=192),
        "deepseek_mla": tiny_draft(seed=1, dtype=torch.float64, draft_vocab_size=192, architecture="deepseek_mla"),
    }
    batches = {}
    for name, draft in drafts.items():
        batch = tiny_batch(draft.config, B=2, T=T, pad=4, seed=3)  # post-shift; row 1: 4 padding slots
        g = torch.Generator().manual_seed(7)
        batch = batch | {k: batch[k].double() for k in ("aux_hidden_states", "target_logits")}
        H_t = draft.config.target_hidden_size
        batch["final_hidden"] = torch.randn(2, T, H_t, generator=g, dtype=torch.float64)
        batch["lm_head_weight"] = torch.randn(draft.config.vocab_size, H_t, generator=g, dtype=torch.float64) / 4
        batches[name] = batch
    return drafts, batches


def _run(draft, batch, case, shard=None, group=None):
    _, backend, source, step = case
    draft.zero_grad(set_to_none=True)
    sources = {source: batch[source]} | (
        {"lm_head_weight": batch["lm_head_weight"]} if source == "final_hidden" else {}
    )
    out = ttt_loss(
        draft, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["aux_hidden_states"],
        **sources, ttt_steps=K, draft_step_fn=STEPS[step], loss_backend=backend, return_argmax=True,
        step_loss_fn=soft_ce64 if backend == "plain" else ttt_loss.__kwdefaults__["step_loss_fn"],
        sequence_shard=shard, sequence_group=group,
    )  # fmt: skip
    out.loss.backward()
    counts = ("per_step_correct", "per_step_valid", "step_prefix_hits", "step_valid")
    return {
        "loss": out.loss.detach(),
        "per_step": out.per_step_loss.detach(),
        "counts": {name: getattr(out, name) for name in counts},
        "argmax": out.draft_argmax,
        "grads": {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None},
    }


def _rank(rank, world, drafts, batches):
    shard = SequenceShard.of_group(T)
    return {case: _run(drafts[case[0]], batches[case[0]], case, shard) for case in CASES}


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp", [2, 4])
def test_sharded_ttt_loss_adds_up_to_the_one_process_unroll(sp):
    drafts, batches = _setup()
    ranks = launch_local(_rank, sp, drafts, batches)
    for case in CASES:
        ref = _run(drafts[case[0]], batches[case[0]], case)
        assert ref["counts"]["per_step_valid"].min() > 0
        tight = case[1] == "plain" and case[0] == "k3"
        # chunked: the fused soft CE is fp32 by design; deepseek_mla: its RMSNorm weight is applied in fp32
        tol = {"rtol": 1e-10, "atol": 1e-12} if tight else {"rtol": 2e-5, "atol": 1e-7}
        torch.testing.assert_close(sum(r[case]["per_step"] for r in ranks), ref["per_step"], **tol, msg=str(case))
        torch.testing.assert_close(sum(r[case]["loss"] for r in ranks), ref["loss"], **tol, msg=str(case))
        for name, count in ref["counts"].items():
            assert torch.equal(sum(r[case]["counts"][name] for r in ranks), count), (case, name)
        # each rank's argmax covers its slots [start, end) of the padded sequence
        tiled = torch.cat([r[case]["argmax"] for r in ranks], dim=2)[:, :, :T]
        real = batches[case[0]]["attention_mask"].bool()
        assert torch.equal(tiled[:, real], ref["argmax"][:, real]), case
        assert len(ref["grads"]) > 5
        for name, grad in ref["grads"].items():
            parts = [r[case]["grads"][name] for r in ranks]
            torch.testing.assert_close(sum(parts), grad, **tol, msg=f"{case} {name}")
            if name.startswith("midlayer.self_attn"):
                assert not torch.allclose(parts[0], grad, rtol=1e-6, atol=0), (case, name)  # a share, not the whole


def test_one_rank_shard_is_the_whole_sequence_unroll():
    drafts, batches = _setup()
    case = ("k3", "chunked", "final_hidden", "plain")
    ref = _run(drafts["k3"], batches["k3"], case)
    same = _run(drafts["k3"], batches["k3"], case, SequenceShard(1, 0, T))  # size 1: no process group needed
    assert torch.equal(same["loss"], ref["loss"]) and torch.equal(same["per_step"], ref["per_step"])
    for name, grad in ref["grads"].items():
        assert torch.equal(same["grads"][name], grad), name


def _wrong_teacher_rank(rank, world, draft, batch):
    from lightning_eagle.training.teacher import compute_teacher

    teacher = compute_teacher(draft, batch["loss_mask"], target_logits=batch["target_logits"])  # the whole sequence
    try:
        ttt_loss(
            draft, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["aux_hidden_states"],
            teacher=teacher, ttt_steps=K, sequence_shard=SequenceShard.of_group(T),
        )  # fmt: skip
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.multiprocess
def test_a_whole_sequence_teacher_is_refused_under_sequence_parallelism():
    drafts, batches = _setup()
    for message in launch_local(_wrong_teacher_rank, 2, drafts["k3"], batches["k3"]):
        assert message is not None and "needs the teacher of its window (8 rows" in message, message
