"""EP=2 on the golden K3 checkpoint (2 forked gloo ranks) equals one process (``k3_target.md`` §5.2 required test).

The two ranks get different rows and different token counts (96 and 72 tokens — row 1 without its right padding), as
under a real data-parallel sampler, so the all-to-all runs with uneven splits in every MoE layer.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from lightning_eagle.k3 import KimiK3ForCausalLM
from lightning_eagle.k3.loader import SafetensorsCheckpoint
from lightning_eagle.parallel.dispatcher import AllGatherExpertDispatcher, TorchExpertDispatcher
from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.parallel.shard import enable_expert_parallel, expert_range, routed_expert_bytes

pytestmark = pytest.mark.multiprocess

_EXPERT_KEY = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")


def _rank_inputs(golden_dir) -> list[torch.Tensor]:
    inputs = load_file(str(golden_dir / "target" / "inputs.safetensors"))
    ids, valid = inputs["input_ids"], inputs["attention_mask"].sum(1).tolist()
    return [ids[r : r + 1, : valid[r]] for r in range(2)]  # right padding dropped: causal outputs are unchanged


def _load_recording(path, expert_range_=None):
    """Load the target while recording every checkpoint key whose bytes are read."""
    read: list[str] = []
    original = SafetensorsCheckpoint.get

    def get(self, key):
        read.append(key)
        return original(self, key)

    SafetensorsCheckpoint.get = get
    try:
        model = KimiK3ForCausalLM.from_pretrained(
            path, dtype=torch.float32, expert_range=expert_range_, kda_backend="chunk"
        )
    finally:
        SafetensorsCheckpoint.get = original
    return model, read


def _forward(model, ids):
    cap = model.capture(ids, None, aux_layer_ids=None, return_logits=True)  # default ids [1, L//2-1, L-4]
    return {"logits": cap.logits, "aux": cap.aux_hidden_states, "final": cap.final_hidden}


def _ep_rank(rank, world, path, inputs):
    model, read = _load_recording(path, expert_range(8, world, rank))
    enable_expert_parallel(model, TorchExpertDispatcher(), world, rank)
    out = {"all_to_all": _forward(model, inputs[rank])}
    enable_expert_parallel(model, AllGatherExpertDispatcher(), world, rank)
    out["all_gather"] = _forward(model, inputs[rank])
    out["read"] = read
    out["expert_bytes"] = routed_expert_bytes(model)
    return out


@pytest.fixture(scope="module")
def golden_ep(golden_dir):
    path = golden_dir / "target"
    inputs = _rank_inputs(golden_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single, single_read = _load_recording(path)  # also imports everything once, before the ranks fork
        reference = [_forward(single, ids) for ids in inputs]
    finally:
        torch.set_num_threads(threads)
    ranks = launch_local(_ep_rank, 2, path, inputs, timeout_s=300)
    expected = load_file(str(path / "expected.safetensors"))
    return {
        "inputs": inputs,
        "reference": reference,
        "single_read": single_read,
        "single_bytes": routed_expert_bytes(single),
        "ranks": ranks,
        "expected": expected,
    }


@pytest.mark.parametrize("dispatcher", ["all_to_all", "all_gather"])
def test_ep2_logits_and_aux_states_equal_one_process(golden_ep, dispatcher):
    for rank, ref in enumerate(golden_ep["reference"]):
        got = golden_ep["ranks"][rank][dispatcher]
        for name in ("logits", "aux", "final"):
            torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")


def test_ep2_matches_the_golden_reference_outputs(golden_ep):
    expected = golden_ep["expected"]
    for rank, ids in enumerate(golden_ep["inputs"]):
        got, T = golden_ep["ranks"][rank]["all_to_all"], ids.shape[1]
        torch.testing.assert_close(got["logits"][0], expected["logits"][rank, :T], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(got["aux"][0], expected["eagle3.aux_hidden_states"][rank, :T], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(got["final"][0], expected["final_hidden"][rank, :T], atol=2e-4, rtol=1e-4)


def test_each_rank_materialises_half_of_the_expert_bytes(golden_ep):
    single = golden_ep["single_bytes"]
    assert single > 0
    assert [r["expert_bytes"] for r in golden_ep["ranks"]] == [single // 2, single // 2]


def test_each_rank_reads_only_its_experts_and_every_shared_weight(golden_ep):
    single_read = golden_ep["single_read"]
    shared = {k for k in single_read if not _EXPERT_KEY.search(k)}
    all_experts = {k for k in single_read if _EXPERT_KEY.search(k)}
    assert len(all_experts) == 7 * 8 * 3 * 2  # 7 MoE layers × 8 experts × w1/w2/w3 × packed/scale
    for rank, out in enumerate(golden_ep["ranks"]):
        read = out["read"]
        assert len(read) == len(set(read))  # each tensor read once
        experts = {k for k in read if _EXPERT_KEY.search(k)}
        assert {k for k in read if not _EXPERT_KEY.search(k)} == shared
        start, count = expert_range(8, 2, rank)
        owned = {k for k in all_experts if start <= int(_EXPERT_KEY.search(k).group(2)) < start + count}
        assert experts == owned and len(experts) == len(all_experts) // 2
