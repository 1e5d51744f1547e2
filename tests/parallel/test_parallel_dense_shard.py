"""The frozen target's dense weights sharded with FSDP2 over all ranks (forked gloo ranks, the golden K3 target).

Every rank loads only its rows of each dense tensor (and, with EP, only its experts), holds ``1/world`` of the dense
bytes, and the sharded model's outputs equal the single-process model's and the golden reference's.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh

from lightning_eagle.k3 import KimiK3ForCausalLM
from lightning_eagle.k3.fp32_parameters import is_fp32_parameter
from lightning_eagle.k3.loader import SafetensorsCheckpoint
from lightning_eagle.parallel.dense_shard import dense_bytes_held, gathered_weight, shard_dense_weights
from lightning_eagle.parallel.dispatcher import TorchExpertDispatcher
from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.parallel.shard import enable_expert_parallel, expert_range

pytestmark = pytest.mark.multiprocess


def _inputs(golden_dir) -> list[torch.Tensor]:
    inputs = load_file(str(golden_dir / "target" / "inputs.safetensors"))
    ids, valid = inputs["input_ids"], inputs["attention_mask"].sum(1).tolist()
    return [ids[r : r + 1, : valid[r]] for r in range(2)]


def _recording_load(path, **kwargs):
    """Load while counting the bytes each checkpoint read returns."""
    read = {"bytes": 0}
    original = SafetensorsCheckpoint.get

    def get(self, key, rows=None):
        t = original(self, key, rows)
        read["bytes"] += t.numel() * t.element_size()
        return t

    SafetensorsCheckpoint.get = get
    try:
        model = KimiK3ForCausalLM.from_pretrained(path, dtype=torch.float32, kda_backend="chunk", **kwargs)
    finally:
        SafetensorsCheckpoint.get = original
    return model, read["bytes"]


def _capture(model, ids):
    cap = model.capture(ids, None, aux_layer_ids=None, return_logits=True)
    return {"logits": cap.logits, "aux": cap.aux_hidden_states, "final": cap.final_hidden}


def _rank(rank, world, path, inputs, ep):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    er = expert_range(8, ep, rank % ep) if ep > 1 else None
    model, read = _recording_load(path, expert_range=er, shard=partial(shard_dense_weights, mesh=mesh))
    if ep > 1:
        enable_expert_parallel(model, TorchExpertDispatcher(), ep, rank % ep)
    held = dense_bytes_held(model)
    # Every rank runs the same layers (each layer's gather is a collective); rows differ per rank as under DP.
    out = {"held": held, "read": read, "outputs": [_capture(model, ids) for ids in inputs]}
    with gathered_weight(model.lm_head) as weight:
        out["lm_head"] = weight.clone()
    out["embed"] = model.model.embed_tokens.weight.full_tensor().clone()
    out["still_sharded"] = dense_bytes_held(model) == held  # gathers were freed after use
    bf16 = KimiK3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, expert_range=er, kda_backend="chunk",
                                             shard=partial(shard_dense_weights, mesh=mesh))  # fmt: skip
    out["dtypes"] = {name: (p.dtype, type(p).__name__) for name, p in bf16.named_parameters()}
    return out


@pytest.fixture(scope="module")
def sharded(golden_dir):
    path = golden_dir / "target"
    inputs = _inputs(golden_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single, single_read = _recording_load(path)
        reference = [_capture(single, ids) for ids in inputs]
    finally:
        torch.set_num_threads(threads)
    runs = {
        "world2": launch_local(_rank, 2, path, inputs, 1, timeout_s=300),
        "world2_ep2": launch_local(_rank, 2, path, inputs, 2, timeout_s=300),
        "world4_ep4": launch_local(_rank, 4, path, inputs, 4, timeout_s=300),
    }
    return {
        "single": single,
        "single_read": single_read,
        "single_held": dense_bytes_held(single),
        "reference": reference,
        "expected": load_file(str(path / "expected.safetensors")),
        "inputs": inputs,
        "runs": runs,
    }


RUNS = {"world2": 2, "world2_ep2": 2, "world4_ep4": 4}


@pytest.mark.parametrize("run", RUNS)
def test_sharded_target_equals_one_process_and_the_golden(sharded, run):
    expected = sharded["expected"]
    for rank, out in enumerate(sharded["runs"][run]):
        for row, (got, ref) in enumerate(zip(out["outputs"], sharded["reference"])):
            for name in ("logits", "aux", "final"):
                torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=f"{run} r{rank} {name}")
            T = sharded["inputs"][row].shape[1]
            torch.testing.assert_close(got["logits"][0], expected["logits"][row, :T], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("run", RUNS)
def test_each_rank_holds_its_share_of_the_dense_bytes_and_gathers_exactly(sharded, run):
    full = sharded["single_held"]
    single = sharded["single"]
    largest_layer = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in single.model.layers)
    for out in sharded["runs"][run]:
        # 1/world of every dim-0-split tensor, ± one row per tensor; root norms stay replicated (a few H-vectors).
        assert abs(out["held"] - full / RUNS[run]) < 0.01 * full, (out["held"], full)
        assert out["still_sharded"]
        torch.testing.assert_close(out["lm_head"], single.lm_head.weight, atol=0, rtol=0)  # exact: a copy
        torch.testing.assert_close(out["embed"], single.model.embed_tokens.weight, atol=0, rtol=0)  # exact: a copy
    assert largest_layer < full / 4  # the transient per-layer gather is small next to the saving


def test_fp32_islands_stay_fp32_in_a_sharded_bf16_target(sharded):
    for out in sharded["runs"]["world2_ep2"]:
        islands = {n: d for n, d in out["dtypes"].items() if is_fp32_parameter(n)}
        assert islands and all(dtype == torch.float32 for dtype, _ in islands.values()), islands
        rest = {n: d for n, d in out["dtypes"].items() if not is_fp32_parameter(n)}
        assert all(dtype == torch.bfloat16 for dtype, _ in rest.values())
        assert {kind for _, kind in out["dtypes"].values()} == {"DTensor", "Parameter"}  # experts/root norms plain


@pytest.mark.parametrize("run", ["world2_ep2", "world4_ep4"])
def test_with_ep_over_the_world_each_rank_reads_its_share_of_the_file(sharded, run):
    single_read = sharded["single_read"]
    for out in sharded["runs"][run]:
        assert abs(out["read"] - single_read / RUNS[run]) < 0.03 * single_read, (out["read"], single_read)


def test_without_ep_the_ranks_split_the_dense_bytes_and_each_reads_every_expert(sharded):
    """Bytes read = this rank's dense rows + all experts: the two ranks together read the dense part once."""
    single = sharded["single_read"]
    ranks = sharded["runs"]["world2"]
    ep_ranks = sharded["runs"]["world2_ep2"]
    experts_half = ranks[0]["read"] - ep_ranks[0]["read"]  # what EP 2 saves rank 0: half of the experts
    assert experts_half > 0
    assert abs(sum(out["read"] for out in ranks) - (single + 2 * experts_half)) < 0.01 * single
