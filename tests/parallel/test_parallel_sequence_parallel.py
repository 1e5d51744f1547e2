"""Draft sequence parallelism (Ulysses over the TTT unroll) equals one process: per-step losses and every draft
gradient, summed over the SP group, match ``ttt_loss`` on the whole sequence (fp64), for sp = 2 and 4 on gloo, with
right padding (rows and the pad up to a multiple of sp), eager / flash_lse attention, plain and checkpointed steps —
and composed with an expert-parallel target (world 4, EP 2, SP 2)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from draft_helpers import tiny_batch, tiny_draft

from lightning_eagle.parallel import ParallelLayout, UnsupportedLayoutError
from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.parallel.sequence_parallel import (
    SequenceShard,
    check_sequence_parallel_heads,
    draft_sequence_parallel_mesh,
    global_step_loss,
    head_to_sequence_shards,
    local_unroll_inputs,
    reduce_draft_gradients,
    sequence_to_head_shards,
    sum_over_group,
)
from lightning_eagle.parallel.sequence_parallel_cache import (
    SequenceParallelTTTCache,
    checkpointed_sequence_parallel_draft_step,
    sequence_parallel_draft_step,
)
from lightning_eagle.parallel.strategy import ExpertParallelStrategy
from lightning_eagle.training.loss import step_weights
from lightning_eagle.training.shift import shift_target_outputs
from lightning_eagle.training.teacher import compute_teacher
from lightning_eagle.training.ttt import checkpointed_draft_step, draft_step, ttt_loss

K = 4
T = 11  # padded to 12 for sp = 2 and 4: the last shard slot(s) are added padding
ASSET = Path(__file__).resolve().parents[2] / "lightning_eagle" / "assets" / "k3-tiny-chat"


def soft_ce64(logits, target_probs, position_mask):
    """``soft_cross_entropy`` without the fp32 cast, so that the comparison is fp64-tight."""
    per_position = -(target_probs.to(logits.dtype) * torch.log_softmax(logits, dim=-1)).sum(-1)
    mask = position_mask.to(torch.bool)
    return torch.where(mask, per_position, torch.zeros_like(per_position)).sum() / mask.sum().clamp_min(1)


STEPS = {
    "plain": draft_step,
    "checkpointed": checkpointed_draft_step,  # the unroll's own checkpointing reaches the SP cache through replay()
    "sp": sequence_parallel_draft_step,
    "sp_checkpointed": checkpointed_sequence_parallel_draft_step,
}


def sp_unroll(draft, batch, group, step_fn, teacher_source="target_logits", lm_head_weight=None):
    """The test's own K-step driver on this rank's slots: ``ttt_loss``'s rules with an SP cache and global counts.
    ``batch`` is post-shift. Returns the rank's loss share and per-step shares."""
    shard = SequenceShard.of_group(batch["input_ids"].shape[1], group)
    inputs = local_unroll_inputs(
        shard,
        K,
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        loss_mask=batch["loss_mask"],
        aux_hidden_states=batch["aux_hidden_states"],
        **{teacher_source: batch[teacher_source]},
    )
    sources = {"target_logits": inputs.target_logits, "final_hidden": inputs.final_hidden}
    teacher = compute_teacher(
        draft, inputs.loss_mask, **{teacher_source: sources[teacher_source]}, lm_head_weight=lm_head_weight
    )
    hidden = draft.project(inputs.aux_hidden_states)
    cache = SequenceParallelTTTCache(shard, group)
    local_valid, global_valid = inputs.supervised_counts(teacher.pos, group)
    losses = []
    for k in range(K):
        hidden = step_fn(draft, inputs.step(inputs.input_ids, k), hidden, inputs.attention_mask, cache)
        probs, pos = inputs.step(teacher.probs, k), inputs.step(teacher.pos, k)
        local_loss = soft_ce64(draft.logits(hidden), probs, pos)
        losses.append(global_step_loss(local_loss, local_valid[k], global_valid[k]))
    assert len(cache) == K and cache.keys[0].shape[1:3] == (
        draft.config.num_attention_heads // shard.size,
        shard.padded_length,
    )
    per_step = torch.stack(losses)
    weights = step_weights(K)  # fp32, summed in fp32: as ttt_loss does
    return (weights * per_step).sum() / weights.sum(), per_step


def _grads(draft):
    return {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def _reference(draft, batch, step_fn=draft_step):
    draft.zero_grad(set_to_none=True)
    inputs = [batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "target_logits")]
    out = ttt_loss(draft, *inputs, ttt_steps=K, step_loss_fn=soft_ce64, draft_step_fn=step_fn)
    out.loss.backward()
    return {"loss": out.loss.detach(), "per_step": out.per_step_loss.detach(), "grads": _grads(draft)}


def _post_shift_batch(draft):
    batch = tiny_batch(draft.config, B=2, T=T, pad=4, seed=3)  # post-shift already; row 1: 4 padding slots
    return batch | {k: batch[k].double() for k in ("aux_hidden_states", "target_logits")}


CASES = [(backend, step) for backend in ("eager", "flash_lse") for step in STEPS] + [("sdpa_mask", "plain")]


def _sp_rank(rank, world, draft, batch, deepseek, deepseek_batch):
    out = {}
    for backend, step in CASES:
        draft.attention_backend = backend
        draft.zero_grad(set_to_none=True)
        loss, per_step = sp_unroll(draft, batch, None, STEPS[step])
        loss.backward()
        out[backend, step] = {"loss": loss.detach(), "per_step": per_step.detach(), "grads": _grads(draft)}
    # A rotary (deepseek_mla) layer needs the global positions start + t + k: the SP steps pass them.
    for step in ("sp", "sp_checkpointed"):
        deepseek.zero_grad(set_to_none=True)
        loss, per_step = sp_unroll(deepseek, deepseek_batch, None, STEPS[step])
        loss.backward()
        out["deepseek", step] = {"loss": loss.detach(), "per_step": per_step.detach(), "grads": _grads(deepseek)}
    return out


def _assert_sums_match(ranks, key, reference, grad_tol=None):
    loss = sum(r[key]["loss"] for r in ranks)
    per_step = sum(r[key]["per_step"] for r in ranks)
    torch.testing.assert_close(per_step, reference["per_step"], rtol=1e-10, atol=1e-12, msg=str(key))
    torch.testing.assert_close(loss, reference["loss"], rtol=1e-10, atol=1e-12, msg=str(key))
    assert all(r[key]["grads"].keys() == reference["grads"].keys() for r in ranks) and len(reference["grads"]) > 5
    for name, grad in reference["grads"].items():
        parts = [r[key]["grads"][name] for r in ranks]
        assert not torch.allclose(parts[0], grad, rtol=1e-6, atol=0), (key, name)  # a share, not the whole
        tol = grad_tol or {"rtol": 1e-9, "atol": 1e-12}
        torch.testing.assert_close(sum(parts), grad, **tol, msg=f"{key} {name}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp", [2, 4])
def test_sequence_parallel_unroll_equals_one_process(sp):
    # 192 of 256 ids in the draft vocabulary: most slots are supervised, on both sides of every shard border.
    draft = tiny_draft(seed=0, dtype=torch.float64, draft_vocab_size=192)
    deepseek = tiny_draft(seed=1, dtype=torch.float64, draft_vocab_size=192, architecture="deepseek_mla")
    batch, deepseek_batch = _post_shift_batch(draft), _post_shift_batch(deepseek)
    assert batch["loss_mask"][:, -K:].any() and not batch["attention_mask"][1, -3:].any()  # shard borders matter
    references = {}
    for backend in ("eager", "flash_lse", "sdpa_mask"):
        draft.attention_backend = backend
        references[backend] = _reference(draft, batch)
    references["deepseek"] = _reference(deepseek, deepseek_batch)
    ranks = launch_local(_sp_rank, sp, draft, batch, deepseek, deepseek_batch)
    for backend, step in CASES:
        _assert_sums_match(ranks, (backend, step), references[backend])
    for step in ("sp", "sp_checkpointed"):
        # The engine RMSNorm applies its weight in fp32: its weight gradients are fp32 sums over the slots, whose
        # order differs when the slots are split (every other gradient stays fp64-exact).
        _assert_sums_match(ranks, ("deepseek", step), references["deepseek"], {"rtol": 1e-6, "atol": 1e-9})


# ---- the exchange itself -------------------------------------------------------------------------------------------
def _exchange_rank(rank, world):
    g = torch.Generator().manual_seed(0)
    full_q = torch.randn(2, 4, 8, 3, generator=g, dtype=torch.float64)  # [B,n,T,d]: every rank builds the same
    full_v = torch.randn(2, 4, 8, 5, generator=g, dtype=torch.float64)
    shard = SequenceShard(world, rank, 8)
    q = shard.local(full_q, dim=2).clone().requires_grad_(True)
    v = shard.local(full_v, dim=2).clone().requires_grad_(True)
    hq, hv = sequence_to_head_shards((q, v))
    h = 4 // world
    heads = slice(rank * h, (rank + 1) * h)
    back = head_to_sequence_shards(hv * 2)
    cache, refused = SequenceParallelTTTCache(shard), False
    try:
        cache.bind_mask(torch.ones(2, shard.local_length))  # a per-rank slice instead of the full mask
    except ValueError as error:
        refused = "binds the full padded [B,T] mask (T = 8)" in str(error)
    (back * torch.arange(5.0, dtype=torch.float64)).sum().backward()
    return {
        "q_heads": torch.equal(hq, full_q[:, heads]),
        "v_heads": torch.equal(hv, full_v[:, heads]),
        "round_trip": torch.equal(back, 2 * shard.local(full_v, dim=2)),
        "dv": torch.equal(v.grad, 2 * torch.arange(5.0, dtype=torch.float64).expand_as(v)),
        "dq": bool((q.grad == 0).all()),  # packed with v into one exchange: a zero gradient, not None
        "local_mask_refused": refused,
    }


@pytest.mark.multiprocess
def test_all_to_all_moves_heads_and_slots_and_back():
    for out in launch_local(_exchange_rank, 2):
        assert all(out.values()) and len(out) == 6, out


# ---- composition with an expert-parallel target (world 4, EP 2 or 4, SP 2) ----------------------------------------
def _ep_target(ep, ep_rank):
    from lightning_eagle.k3 import KimiK3ForCausalLM

    expert_range_ = None if ep == 1 else (ep_rank * 8 // ep, 8 // ep)
    # fp32: the EP dispatcher's partial sums are fp32 by design (an fp64 target is a single-process tool)
    return KimiK3ForCausalLM.from_pretrained(
        ASSET, dtype=torch.float32, expert_range=expert_range_, kda_backend="chunk"
    )


@torch.no_grad()
def _target_batch(target, ids, attention_mask, loss_mask):
    cap = target.capture(ids, attention_mask, aux_layer_ids=[1, 3, 4])
    shifted_ids, shifted_mask, final = shift_target_outputs(ids, loss_mask, cap.final_hidden)
    return {
        "input_ids": shifted_ids,
        "loss_mask": shifted_mask,
        "attention_mask": attention_mask,
        "aux_hidden_states": cap.aux_hidden_states.double(),
        "final_hidden": final.double(),
    }


def _ep_sp_rank(rank, world, draft, rows, ep, sp):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_eagle.parallel.dispatcher import TorchExpertDispatcher
    from lightning_eagle.parallel.shard import enable_expert_parallel

    # The groups as ExpertParallelStrategy.setup_environment builds them.
    ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("data_parallel", "expert_parallel"))
    sp_group = draft_sequence_parallel_mesh("cpu", world, sp)["draft_sequence_parallel"].get_group()
    ep_rank = ep_mesh["expert_parallel"].get_local_rank()
    target = _ep_target(ep, ep_rank)
    enable_expert_parallel(target, TorchExpertDispatcher(ep_mesh["expert_parallel"].get_group()), ep, ep_rank)
    batch = _target_batch(target, *rows[rank // sp])  # the sampler's rank: rank // sp
    draft.zero_grad(set_to_none=True)
    head = target.lm_head.weight
    loss, per_step = sp_unroll(draft, batch, sp_group, sequence_parallel_draft_step, "final_hidden", head)
    loss.backward()
    local = _grads(draft)
    count = reduce_draft_gradients(draft.parameters(), sp)
    return {
        "batch": batch,
        "per_step": per_step.detach(),
        "loss_sum": sum_over_group(loss, sp_group),
        "local": local,
        "reduced": _grads(draft),
        "count": count,
        "sp_ranks": dist.get_process_group_ranks(sp_group),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_target_with_sequence_parallel_draft(ep):
    from lightning_eagle.draft import Eagle3DraftConfig, build_draft
    from lightning_eagle.k3.loader import read_config

    torch.manual_seed(0)
    config = Eagle3DraftConfig.from_target_config(read_config(ASSET), draft_vocab_size=384, aux_layer_ids=[1, 3, 4])
    draft = build_draft(config).double()
    with torch.no_grad():
        draft.set_vocab_mapping(torch.sort(torch.randperm(config.vocab_size)[:384]).values)
    g = torch.Generator().manual_seed(5)
    rows = []
    for pad in (0, 3):  # two draft data-parallel groups with different rows; the second right-padded
        ids = torch.randint(0, config.vocab_size, (2, T), generator=g)
        attention_mask = torch.ones(2, T, dtype=torch.long)
        attention_mask[1, T - pad :] = 0
        loss_mask = attention_mask.clone()
        loss_mask[:, :2] = 0
        rows.append((ids, attention_mask, loss_mask))
    ranks = launch_local(_ep_sp_rank, 4, draft, rows, ep, 2, timeout_s=300)
    assert [r["sp_ranks"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    full = _ep_target(1, 0)
    means = {}
    for group in range(2):
        members = ranks[2 * group : 2 * group + 2]
        # Every rank of an SP group holds the same target outputs: the draft's shards are of one sequence.
        for key, value in members[0]["batch"].items():
            assert torch.equal(value, members[1]["batch"][key]), key
        reference_batch = _target_batch(full, *rows[group])
        for key in ("aux_hidden_states", "final_hidden"):  # the EP target is the one-process target
            torch.testing.assert_close(members[0]["batch"][key], reference_batch[key], rtol=1e-5, atol=1e-5)
        batch = members[0]["batch"]
        draft.zero_grad(set_to_none=True)
        keys = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states")
        out = ttt_loss(draft, *[batch[k] for k in keys], ttt_steps=K, final_hidden=batch["final_hidden"],
                       lm_head_weight=full.lm_head.weight, step_loss_fn=soft_ce64)  # fmt: skip
        out.loss.backward()
        assert out.per_step_valid.min() > 0
        torch.testing.assert_close(sum(r["per_step"] for r in members), out.per_step_loss, rtol=1e-10, atol=1e-12)
        for r in members:
            torch.testing.assert_close(r["loss_sum"], out.loss.detach(), rtol=1e-10, atol=1e-12)
        for name, grad in _grads(draft).items():
            torch.testing.assert_close(sum(r["local"][name] for r in members), grad, rtol=1e-9, atol=1e-12, msg=name)
            means[name] = means.get(name, 0) + grad / 2
    # What the strategy's reduction gives every rank: Σ over the SP group, mean over the two data-parallel groups.
    for r in ranks:
        assert r["count"] == len(means)
        for name, mean in means.items():
            torch.testing.assert_close(r["reduced"][name], mean, rtol=1e-9, atol=1e-12, msg=name)


# ---- shards, settings, strategy (no processes) ---------------------------------------------------------------------
def test_shard_slots_windows_and_padding():
    x = torch.arange(1, 12).view(1, 11)  # T = 11 → padded 12, sp = 4 → 3 slots each
    shards = [SequenceShard(4, r, 11) for r in range(4)]
    assert [(s.start, s.end) for s in shards] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert shards[3].local(x).tolist() == [[10, 11, 0]]
    window = shards[2].window(x, 3)  # rows [6, 11): slot t's step-k row is t + k
    assert window.tolist() == [[7, 8, 9, 10, 11]]
    assert shards[2].step(window, 2).tolist() == [[9, 10, 11]]
    assert shards[3].window(x, 3).tolist() == [[10, 11, 0, 0, 0]]  # zero past T, as the unroll's shift
    assert SequenceShard(4, 3, 5).local(x[:, :5]).tolist() == [[0, 0]]  # a shard entirely in the padding
    mask = shards[0].padded_attention_mask(None, batch=2)
    assert mask.tolist() == [[1] * 11 + [0]] * 2
    assert SequenceShard(2, 0, 12).padded_attention_mask(None, batch=2) is None
    assert shards[1].position_ids(2).tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="draft_sequence_parallel_size=2 with group rank 2"):
        SequenceShard(2, 2, 8)


def test_heads_must_divide_by_the_group_size():
    check_sequence_parallel_heads(4, 4)
    with pytest.raises(ValueError, match=r"draft_sequence_parallel_size=3 must divide the draft's num_attention_heads"):
        check_sequence_parallel_heads(4, 3)


def test_the_setting_must_divide_the_world_with_its_own_message():
    assert ParallelLayout(draft_sequence_parallel_size=2).refine(world_size=4).draft_data_parallel_size == 2
    with pytest.raises(ValueError, match=r"draft_sequence_parallel_size \(3\) must divide the world size \(4\)"):
        ParallelLayout(draft_sequence_parallel_size=3, world_size=4)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="draft_sequence_parallel_size must be a positive int"):
            ParallelLayout(draft_sequence_parallel_size=bad)
    # The target stays refused as before, with the same text, whatever the draft's sequence sharding.
    with pytest.raises(UnsupportedLayoutError, match="context_parallel_size=2: the K3 target supports neither"):
        ParallelLayout(draft_sequence_parallel_size=2, context_parallel_size=2)


def test_strategy_sampler_and_group_rank_with_expert_and_sequence_parallel():
    strategy = ExpertParallelStrategy(expert_parallel_size=2, draft_sequence_parallel_size=2, start_method="fork")
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    assert strategy.layout.data_parallel_size == 2 and strategy.layout.draft_data_parallel_size == 2
    seen = []
    for rank in range(4):
        trainer.strategy.cluster_environment.set_global_rank(rank)
        seen.append((trainer.strategy.distributed_sampler_kwargs, strategy.draft_sequence_parallel_rank))
        assert strategy.sequence_shard(11) == SequenceShard(2, rank % 2, 11)
    assert seen == [({"num_replicas": 2, "rank": r // 2}, r % 2) for r in range(4)]
    assert strategy.draft_sequence_parallel_group is None  # built in setup_environment, with the process group
    with pytest.raises(ValueError, match=r"draft_sequence_parallel_size \(3\) must divide the world size \(4\)"):
        L.Trainer(accelerator="cpu", devices=4, logger=False,
                  strategy=ExpertParallelStrategy(draft_sequence_parallel_size=3, start_method="fork"))  # fmt: skip
