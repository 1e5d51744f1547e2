"""The real CLI under ``torchrun`` as 2 simulated nodes × 2 processes (gloo, localhost rendezvous), EP 4 spanning
both nodes and the target's dense weights sharded over all 4 ranks, against one process with gradient accumulation.

Equivalence (as in ``test_parallel_eagle3_fit.py``): each rank divides its loss by its own supervised-token count and
the strategy averages draft gradients over the world, so a 4-rank step on one row per rank equals a 1-rank step with
``accumulate_grad_batches=4`` over the same 4 rows. Checkpoints move between the two layouts in both directions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_eagle.data import bundled_sample_path
from lightning_eagle.parallel.local_launch import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROWS, STEPS = 16, 2


def _config(tmp: Path, root: Path, devices: int, num_nodes: int, ep: int, accumulate: int) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "num_nodes": num_nodes,
            "strategy": {
                "class_path": "lightning_eagle.parallel.ExpertParallelStrategy",
                "init_args": {"expert_parallel_size": ep},
            },
            "precision": "32-true",
            "max_steps": STEPS,
            "accumulate_grad_batches": accumulate,
            "limit_val_batches": 0,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(root),
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {
                        "filename": "step{step}",
                        "auto_insert_metric_name": False,
                        "every_n_train_steps": 1,
                        "save_top_k": -1,
                    },
                }
            ],
        },
        "model": {
            "target": {"path": "quickstart", "aux_layer_ids": [1, 3, 5], "dtype": "float32"},
            "objective": {"ttt_steps": 2},
            # SGD is linear in the gradient: the float noise of a different summation order stays at noise level
            # (Adam would turn the last-bit difference of a near-zero gradient into an lr-sized weight difference).
            "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.9}},
            "draft": {"dtype": "float32", "config": {"intermediate_size": 64}},
        },
        "data": {
            "train_files": [str(tmp / "rows.jsonl")],
            "tokenizer": "synthetic",
            "max_length": 96,
            "batch_size": 1,
            "val_fraction": 0.0,
            "thinking_effort": None,
            "draft_vocab_size": 320,
            "use_cache": False,
        },
    }
    path = root.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _fit_one(config: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "lightning_eagle.commands", "fit", "--config", str(config), *extra]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def _fit_two_nodes(config: Path, *extra: str) -> list[str]:
    """Two torchrun agents, one per simulated node, meeting at a localhost rendezvous."""
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(port)]  # fmt: skip
    cli = ["-m", "lightning_eagle.commands", "fit", "--config", str(config), *extra]
    nodes = [
        subprocess.Popen(
            [*torchrun, "--node_rank", str(node), *cli],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    for proc in nodes:
        try:
            outputs.append(proc.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for p in nodes:
                p.kill()
            raise
    for node, (proc, out) in enumerate(zip(nodes, outputs)):
        assert proc.returncode == 0, f"node {node}:\n{out[-4000:]}"
    return outputs


def _draft(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("draft.")}


def _assert_same_draft(a: Path, b: Path) -> None:
    da, db = _draft(a), _draft(b)
    assert da.keys() == db.keys() and da
    for name in da:
        # A 4-way all-reduce and a 4-micro-batch accumulation sum in different orders (last-bit differences); a wrong
        # row pairing or a missing average moves weights by orders of magnitude more.
        torch.testing.assert_close(da[name], db[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    with open(bundled_sample_path()) as f:
        (tmp / "rows.jsonl").write_text("".join(next(f) for _ in range(ROWS)))
    one, four = tmp / "one", tmp / "four"
    one_config = _config(tmp, one, devices=1, num_nodes=1, ep=1, accumulate=4)
    four_config = _config(tmp, four, devices=2, num_nodes=2, ep=4, accumulate=1)
    _fit_one(one_config)
    (tmp / "four_nodes.json").write_text(json.dumps(_fit_two_nodes(four_config)))
    # Cross-resume: the 4-rank step-1 checkpoint on one process, the 1-rank step-1 checkpoint on 4 ranks.
    four_on_one = _config(tmp, tmp / "four_on_one", devices=1, num_nodes=1, ep=1, accumulate=4)
    _fit_one(four_on_one, "--ckpt_path", str(four / "checkpoints" / "step1.ckpt"))
    one_on_four = _config(tmp, tmp / "one_on_four", devices=2, num_nodes=2, ep=4, accumulate=1)
    _fit_two_nodes(one_on_four, "--ckpt_path", str(one / "checkpoints" / "step1.ckpt"))
    return tmp


def test_four_ranks_on_two_nodes_equal_one_rank_with_accumulation(runs):
    for step in (1, STEPS):
        _assert_same_draft(runs / "four" / "checkpoints" / f"step{step}.ckpt", runs / "one" / "checkpoints" /
                           f"step{step}.ckpt")  # fmt: skip


def test_four_rank_checkpoint_resumes_on_one_process(runs):
    _assert_same_draft(runs / "four_on_one" / "checkpoints" / f"step{STEPS}.ckpt",
                       runs / "one" / "checkpoints" / f"step{STEPS}.ckpt")  # fmt: skip


def test_one_rank_checkpoint_resumes_on_four_processes(runs):
    _assert_same_draft(runs / "one_on_four" / "checkpoints" / f"step{STEPS}.ckpt",
                       runs / "one" / "checkpoints" / f"step{STEPS}.ckpt")  # fmt: skip


def test_the_four_rank_run_spanned_two_nodes_and_consumed_rows_like_one_rank(runs):
    node0, node1 = json.loads((runs / "four_nodes.json").read_text())
    assert "GLOBAL_RANK: 0, MEMBER: 1/4" in node0 and "GLOBAL_RANK: 1, MEMBER: 2/4" in node0
    assert "GLOBAL_RANK: 2, MEMBER: 3/4" in node1 and "GLOBAL_RANK: 3, MEMBER: 4/4" in node1
    for step in (1, STEPS):
        four = torch.load(runs / "four" / "checkpoints" / f"step{step}.ckpt", map_location="cpu", weights_only=False)
        one = torch.load(runs / "one" / "checkpoints" / f"step{step}.ckpt", map_location="cpu", weights_only=False)
        assert four["ChatDataModule"]["train_position"] == one["ChatDataModule"]["train_position"]
        assert four["ChatDataModule"]["train_position"]["consumed"] == 4 * step
