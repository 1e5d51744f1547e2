"""Token-chunked target forward under expert parallelism (2 forked gloo ranks) == one process, unchunked.

The ranks hold different batches and lengths (rank 0: two right-padded rows of 21 tokens, 6 segments of 4; rank 1:
one row of 9 tokens, 3 segments), so they agree on 6 segments and rank 1 runs 3 empty ones: its MoE layers dispatch
0 tokens while rank 0's dispatch real ones (a mismatch would hang or mix the exchanges up).
"""

from __future__ import annotations

import pytest
import torch
from k3_helpers import tiny_model

from lightning_eagle.k3 import KimiK3ForCausalLM
from lightning_eagle.k3.model import set_token_chunk
from lightning_eagle.parallel.dispatcher import AllGatherExpertDispatcher, TorchExpertDispatcher
from lightning_eagle.parallel.local_launch import launch_local
from lightning_eagle.parallel.shard import enable_expert_parallel, expert_range

pytestmark = pytest.mark.multiprocess

CHUNK = 4


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    if rank == 0:
        ids, mask = torch.randint(3, 256, (2, 21), generator=gen), torch.ones(2, 21, dtype=torch.long)
        mask[1, 15:] = 0
        return ids, mask
    return torch.randint(3, 256, (1, 9), generator=gen), torch.ones(1, 9, dtype=torch.long)


def _slice_of(full: KimiK3ForCausalLM, rank: int, world: int) -> KimiK3ForCausalLM:
    """``full`` holding only EP rank ``rank``'s routed experts (same weights)."""
    start, count = expert_range(full.config.num_experts, world, rank)
    part = KimiK3ForCausalLM(full.config, expert_range=(start, count), kda_backend="chunk")
    weights = full.state_dict()
    for name, tensor in part.state_dict().items():
        source = weights[name]
        if ".experts." in name:
            source = source[start : start + count]
        tensor.copy_(source)
    return part.freeze()


def _capture(model, ids, mask):
    with torch.no_grad():
        cap = model.capture(ids, mask, [0, 2, 5], "mixed", return_logits=True)
    return {"aux": cap.aux_hidden_states, "final": cap.final_hidden, "logits": cap.logits}


def _rank(rank: int, world: int) -> dict:
    full = tiny_model("k3-tiny", kda_backend="chunk")
    ids, mask = _inputs(rank)
    out = {"reference": _capture(full, ids, mask)}  # one process, every expert, unchunked
    part = _slice_of(full, rank, world)
    for name, dispatcher in (("all_to_all", TorchExpertDispatcher()), ("all_gather", AllGatherExpertDispatcher())):
        enable_expert_parallel(part, dispatcher, world, rank)
        set_token_chunk(part, None)
        out[f"{name}/unchunked"] = _capture(part, ids, mask)
        set_token_chunk(part, CHUNK)
        out[f"{name}/chunked"] = _capture(part, ids, mask)
    return out


def test_ep2_chunked_with_different_lengths_equals_one_process():
    results = launch_local(_rank, 2, timeout_s=300)
    for rank, out in enumerate(results):
        ref = out["reference"]
        for case in ("all_to_all/unchunked", "all_to_all/chunked", "all_gather/unchunked", "all_gather/chunked"):
            for name, want in ref.items():
                torch.testing.assert_close(
                    out[case][name], want, atol=1e-4, rtol=1e-4, msg=f"rank {rank} {case} {name}"
                )
        assert ref["final"].shape[:2] == _inputs(rank)[0].shape
