"""A streaming ``cli.py fit`` beside a running ``cli.py extract`` (on a stand-in server computing vLLM's files with our
K3), each side SIGKILLed mid-run and restarted: the producer resumes with the shards it had not finished, the fit
resumes from its last checkpoint, and the resumed run trains every training row exactly once; the shards the fit's
checkpoints passed are removed (``data.remove_consumed``) and the resumed producer does not write them again."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from k3_engine import FakeVllmServer, OurK3Engine

from lightning_eagle.commands.extract import build
from lightning_eagle.features import format as fmt

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CHATS, SHARD_ROWS, BATCH = 44, 8, 4  # 30 training rows, 3 validation rows (30..32): shards 3 and 4 hold them
KILL_PRODUCER_AT = 20  # the 20th request: shards 3, 4 (validation first) and 0 written, shard 1 half done
KILL_FIT_AT = 5  # as the 6th batch starts; the last checkpoint is at step 4


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p)
    return env


def _start(*words: str, log: Path) -> subprocess.Popen:
    handle = open(log, "a")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([sys.executable, str(REPO / "cli.py"), *words], stdout=handle, stderr=subprocess.STDOUT,
                            env=_env(), cwd=REPO)  # fmt: skip


def _finish(process: subprocess.Popen, log: Path, expect: int = 0, timeout: float = 600) -> str:
    code = process.wait(timeout=timeout)
    text = log.read_text()
    assert code == expect, f"exit code {code}, expected {expect}:\n{text[-5000:]}"
    return text


def _fit_config(tmp_path: Path, features: Path, steps: int, kill_at: int | None) -> Path:
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"every_n_train_steps": 2, "save_last": True, "save_top_k": -1}},
        {"class_path": "streaming_callbacks.RecordRows", "init_args": {"path": str(tmp_path / "rows.jsonl")}},
    ]  # fmt: skip
    if kill_at is not None:
        callbacks.append({"class_path": "streaming_callbacks.KillAt", "init_args": {"step": kill_at}})
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": steps, "logger": False,
                    "limit_val_batches": 0, "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path / "fit"), "callbacks": callbacks},
        "model": {"target": {"path": "quickstart", "source": "features", "aux_layer_ids": [1, 3, 5],
                             "aux_stream": "mixed", "dtype": "float32"},
                  "draft": {"attention_backend": "eager", "dtype": "float32", "config": {"intermediate_size": 64}},
                  "objective": {"ttt_steps": 2}},
        "data": {"class_path": "lightning_eagle.features.HiddenStateDataModule",
                 "init_args": {"features_dir": str(features), "batch_size": BATCH, "streaming": True,
                               "remove_consumed": True, "producer_timeout": 600}},
    }  # fmt: skip
    path = tmp_path / f"fit_{kill_at}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_killed_producer_and_killed_fit_resume_and_train_every_row_once(tmp_path):
    from lightning_eagle.data.synthetic_corpus import bundled_sample_path

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(bundled_sample_path().read_text().splitlines(keepends=True)[:CHATS]))
    features, storage = tmp_path / "features", tmp_path / "engine"
    storage.mkdir()
    extract = ["extract", "--config", "quickstart", "--model.target.aux_stream", "mixed", "--data.train_files",
               str(chats), "--data.max_length", "96", "--data.val_fraction", "0.1", "--out", str(features),
               "--dtype", "float32", "--shard-rows", str(SHARD_ROWS), "--concurrency", "2", "--no-progress",
               "--served-env", "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1"]  # fmt: skip
    producers: list[subprocess.Popen] = []

    def kill_the_first_producer(n: int) -> None:
        if n == KILL_PRODUCER_AT:
            os.kill(producers[0].pid, signal.SIGKILL)
            time.sleep(0.5)  # the answer goes to a dead client

    engine = OurK3Engine([2, 4, 6], storage, version="0.32.0")
    with FakeVllmServer(engine, on_request=kill_the_first_producer) as server:
        producers.append(_start(*extract, "--vllm-url", server.url, log=tmp_path / "extract1.log"))
        plan = _wait_for(features / fmt.PLAN_NAME)
        train, shards = plan["rows"]["train"], len(plan["shard_bounds"]) - 1
        assert (train, shards) == (30, 5), plan["rows"]
        steps = -(-train // BATCH)  # one epoch: 7 batches of 4 and one of 2
        fit = _start("fit", "--config", str(_fit_config(tmp_path, features, steps, KILL_FIT_AT)),
                     log=tmp_path / "fit1.log")  # fmt: skip
        _finish(producers[0], tmp_path / "extract1.log", expect=-signal.SIGKILL)
        asked = server.requests  # 20, or 21 when the chunk's other request arrived before the kill
        assert asked - KILL_PRODUCER_AT in (0, 1)
        state = fmt.read_json(features / "producer.json")
        assert state["state"] == "running" and state["shards_done"] == 3  # killed: no chance to say so
        # the fit waits for shard 1 (rows 8..15) meanwhile; the restarted producer resumes
        producers.append(_start(*extract, "--vllm-url", server.url, log=tmp_path / "extract2.log"))
        resumed = _finish(producers[1], tmp_path / "extract2.log")
        assert "2 of 5 shards to write" in resumed
        assert server.requests - asked == 2 * SHARD_ROWS  # shards 1 and 2 only; the killed one's rows again
        _finish(fit, tmp_path / "fit1.log", expect=-signal.SIGKILL)
    assert fmt.read_json(features / "producer.json")["state"] == "finished"
    assert (tmp_path / "fit" / "checkpoints" / "last.ckpt").is_file()
    # the fit, resumed from its last checkpoint (step 4), finishes the epoch
    config = _fit_config(tmp_path, features, steps, kill_at=None)
    last = tmp_path / "fit" / "checkpoints" / "last.ckpt"
    resumed_fit = _start("fit", "--config", str(config), "--ckpt_path", str(last), log=tmp_path / "fit2.log")
    _finish(resumed_fit, tmp_path / "fit2.log")
    records = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    first, second = records[: KILL_FIT_AT + 1], records[KILL_FIT_AT + 1 :]  # the batch killed at is recorded
    assert [r["step"] for r in first] == list(range(KILL_FIT_AT + 1))
    assert [r["step"] for r in second] == list(range(4, steps))  # from the step-4 checkpoint to the epoch's end
    kept = [r for r in first if r["step"] < 4] + second  # what the killed run trained after step 4 was lost with it
    trained = collections.Counter(tuple(row) for r in kept for row in r["rows"])
    planned = build(extract[1:])[0]  # the same plan, built again: every shard done or removed
    assert planned.pending == []
    expected = collections.Counter(tuple(planned.made.rows[r]["input_ids"].tolist()) for r in range(train))
    assert trained == expected  # every training row exactly once
    removed = [k for k in range(shards) if fmt.read_json(features / f"shard-{k:05d}.json").get("removed")]
    assert removed[:2] == [0, 1] and not any((features / fmt.shard_name(k)).exists() for k in removed)


def _wait_for(path: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)
    return fmt.read_json(path)
