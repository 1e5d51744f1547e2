"""Both draft families trained from features vLLM extracted (``cli.py extract``), proven with vLLM's own
``extract_hidden_states`` and hidden-states connector on its CPU build (``CpuHiddenStatesConnector``), on the tiny
DeepSeek-V3 target (``tiny_deepseek.py``; vLLM's CPU build cannot run K3), fp32, read through
``model.target.source: features`` (the teacher head of a non-K3 target):

* EAGLE-3 (taps [3, 0, 2]: not ascending) through an offline engine ``cli.py extract`` starts itself (the extract
  worker); DSpark (taps 0..4 and the final hidden) through a running server started from the line
  ``cli.py extract --print-serve-line`` prints, with a **streaming** ``cli.py fit`` training beside the producer;
* the same runs' shards made by Hugging Face's forward of the same checkpoint (``hf_reference_worker.py``: the
  same protocol and files, vLLM's numbering: id k = ``hidden_states[k]``, id L = the input of the final norm):
  vLLM's shards equal them (tokens and masks exactly, states to fp32 summation order) and so does the first
  training step of each family from them (loss and gradients); an offline ``cli.py fit`` trains from vLLM's.

Engine starts: one offline engine, one server, two Hugging Face workers (seconds each).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from engine_helpers import REFERENCE_ROTARY, REPO
from safetensors.torch import load_file

from lightning_eagle.commands.config_cli import chat_data_cli
from lightning_eagle.features import HiddenStateDataModule
from lightning_eagle.features import format as fmt
from lightning_eagle.features.engine_client import WorkerEngine
from lightning_eagle.features.extract import Producer

pytestmark = pytest.mark.slow

HF_WORKER = (str(Path(__file__).with_name("hf_reference_worker.py")),)
TAPS = {"eagle3": [3, 0, 2], "dspark": [0, 1, 2, 3, 4]}  # vLLM ids [1, 3, 4, 6] and [1, 2, 3, 4, 5, 6]
CHATS = 36  # chats of the bundled corpus: 27 rows of at most 96 tokens, 24 for training in 3 shards of 8, 3 held out
SHARD_ROWS = 8
# max |vLLM - HF| per stored column, fp32: measured 2.6e-6 (id 1) growing to 8.6e-6 (id 6) with depth (summation
# order: MLA's absorbed attention, vLLM's own norms and matmuls); a numbering off by one layer differs by O(1)
ATOL = 1e-4
ENGINE_ARGS = {"compilation_config": REFERENCE_ROTARY, "enforce_eager": True, "max_num_seqs": 4, "seed": 0}
STREAMING_STEPS = 6  # the 24 training rows, read while the producer writes them


def _model(family: str, target: Path) -> dict:
    target_settings = {"path": str(target), "source": "features", "aux_layer_ids": TAPS[family], "dtype": "float32"}
    if family == "eagle3":
        return {"target": target_settings, "draft": {"attention_backend": "eager", "dtype": "float32",
                "config": {"intermediate_size": 64}}, "objective": {"ttt_steps": 2}}  # fmt: skip
    return {"class_path": "lightning_eagle.training.dspark_module.DSparkModule",
            "init_args": {"target": target_settings, "draft": {"preset": "k3-tiny", "dtype": "float32"},
                          "objective": {"num_anchors": 16, "loss_backend": "plain"}}}  # fmt: skip


def _configs(root: Path, family: str, target: Path, chats: Path) -> dict[str, Path]:
    """The run's two configs, as a user writes them: chats for ``extract``, its features folder for ``fit``."""
    trainer = {"accelerator": "cpu", "devices": 1, "precision": "32-true", "logger": False,
               "enable_progress_bar": False, "enable_model_summary": False,
               "default_root_dir": str(root / family)}  # fmt: skip
    data = {"train_files": [str(chats)], "tokenizer": "synthetic", "max_length": 96, "batch_size": 4,
            "val_fraction": 0.1, "thinking_effort": None, "use_cache": False, "seed": 0}  # fmt: skip
    if family == "eagle3":
        data["draft_vocab_size"] = 320
    fit_trainer = {**trainer, "max_steps": 2, "limit_val_batches": 0, "enable_checkpointing": False}
    features = {"class_path": "lightning_eagle.features.HiddenStateDataModule",
                "init_args": {"features_dir": str(root / family / "vllm"), "batch_size": 4}}  # fmt: skip
    out = {}
    for name, config in (
        ("extract", {"seed_everything": 0, "trainer": trainer, "model": _model(family, target), "data": data}),
        ("fit", {"seed_everything": 0, "trainer": fit_trainer, "model": _model(family, target), "data": features}),
    ):
        out[name] = root / f"{family}_{name}.yaml"
        out[name].write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default takes most of the machine's memory
    return env


def _cli(*words: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "cli.py"), *words], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=timeout)  # fmt: skip


def _ok(done: subprocess.CompletedProcess | tuple, what: str) -> str:
    code, out, err = (done.returncode, done.stdout, done.stderr) if hasattr(done, "returncode") else done
    assert code == 0, f"{what} failed (code {code}):\n{out[-3000:]}\n{err[-5000:]}"
    return out + err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The ``vllm serve`` line ``--print-serve-line`` printed, run as vLLM's OpenAI server module (the CPU build's
    ``vllm`` console script fails at import; the module is the same server) with the CPU run's flags added."""

    def __init__(self, python: Path, line: str, log: Path):
        words = shlex.split(line)
        env = _env()
        while "=" in words[0]:
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        assert words[:2] == ["vllm", "serve"], line
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", words[2], *words[3:],
                   "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", "512",
                   "--skip-tokenizer-init", "--enforce-eager", "--max-num-seqs", "4", "--seed", "0",
                   "--compilation-config", json.dumps(REFERENCE_ROTARY)]  # fmt: skip
        env["PYTHONPATH"] = str(REPO)  # the CPU connector's module
        self.log = log
        with open(log, "w") as handle:
            self.process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the server exited:\n{self.log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"the server did not start in {timeout} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _hf_features(vllm_python: Path, config: Path, out: Path, target: Path) -> Path:
    """The run's features made by the Hugging Face reference worker through the same producer."""
    cli = chat_data_cli(["--config", str(config)], False, command="extract")
    producer = Producer(cli.model.target_spec, cli.datamodule, out, dtype="float32", shard_rows=SHARD_ROWS,
                        concurrency=4, log=lambda line: None)  # fmt: skip
    settings = {"model": str(target), "aux_ids": list(producer.capture.ids), "storage": str(out.parent / "hf_files"),
                "dtype": "float32", "max_model_len": 512, "env": {}}  # fmt: skip

    def open_engine(capture):
        return WorkerEngine(settings, log=out.parent / "hf.log", python=str(vllm_python), worker=HF_WORKER)

    return producer.run(open_engine, progress_bar=False)


@pytest.fixture(scope="module")
def extracted(vllm_python, engine_target, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("extract")
    chats = root / "chats.jsonl"
    from lightning_eagle.data.synthetic_corpus import bundled_sample_path

    chats.write_text("".join(bundled_sample_path().read_text().splitlines(keepends=True)[:CHATS]))
    configs = {family: _configs(root, family, engine_target, chats) for family in TAPS}
    common = ["--dtype", "float32", "--shard-rows", str(SHARD_ROWS), "--concurrency", "4", "--no-progress"]
    out: dict = {"root": root, "configs": configs}
    # DSpark: the server first (it starts while the offline engine works)
    printed = _cli("extract", "--config", str(configs["dspark"]["extract"]), "--print-serve-line", "--vllm-cpu",
                   "--vllm-storage", str(root / "server_files"))  # fmt: skip
    _ok(printed, "--print-serve-line")
    line = printed.stdout.strip()  # the line alone on stdout
    out["serve_line"] = line
    server = Server(vllm_python, line, root / "server.log")
    # the streaming DSpark fit, started before its producer: it waits for the folder, then trains as shards arrive
    fit = subprocess.Popen(
        [sys.executable, str(REPO / "cli.py"), "fit", "--config", str(configs["dspark"]["fit"]), "--data.streaming",
         "true", "--data.producer_timeout", "600", "--trainer.max_steps", str(STREAMING_STEPS)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO,
    )  # fmt: skip
    try:
        # EAGLE-3: an offline engine started by the command
        out["eagle3_extract"] = _ok(_cli(
            "extract", "--config", str(configs["eagle3"]["extract"]), "--out", str(root / "eagle3" / "vllm"),
            "--vllm-python", str(vllm_python), "--vllm-cpu", "--vllm-dtype", "float32", "--vllm-storage",
            str(root / "worker_files"),
            "--vllm-engine-args", json.dumps(ENGINE_ARGS), *common), "extract (offline engine)")  # fmt: skip
        for family in TAPS:
            _hf_features(vllm_python, configs[family]["extract"], root / family / "hf", engine_target)
        server.wait_ready()
        # DSpark: the producer on the server, the streaming fit reading its folder as it grows
        out["dspark_extract"] = _ok(_cli(
            "extract", "--config", str(configs["dspark"]["extract"]), "--out", str(root / "dspark" / "vllm"),
            "--vllm-url", server.url, *common), "extract (vllm serve)")  # fmt: skip
        stdout, stderr = fit.communicate(timeout=900)
        out["dspark_streaming_fit"] = _ok((fit.returncode, stdout, stderr), "streaming fit")
    finally:
        server.stop()
        if fit.poll() is None:
            fit.kill()
    out["engine_files"] = sorted(
        p.name for folder in ("server_files", "worker_files") for p in (root / folder).iterdir()
    )
    out["eagle3_fit"] = _ok(_cli("fit", "--config", str(configs["eagle3"]["fit"])), "offline fit (EAGLE-3)")
    return out


def test_the_serve_line_asks_the_runs_ids_through_the_cpu_connector(extracted):
    line = extracted["serve_line"]
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 vllm serve ")  # a non-K3 target: no stream setting
    speculative = json.loads(shlex.split(line)[5])
    assert speculative["method"] == "extract_hidden_states"
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3, 4, 5, 6]
    assert '"kv_connector": "CpuHiddenStatesConnector"' in line
    assert extracted["engine_files"] == []  # every file (and its .lock) the worker and the server wrote was removed


@pytest.mark.parametrize("family", list(TAPS))
def test_vllm_shards_equal_hugging_face_shards(extracted, family):
    folder = extracted["root"] / family
    manifests = {source: fmt.read_json(folder / source / fmt.MANIFEST_NAME) for source in ("vllm", "hf")}
    ids = {"eagle3": [1, 3, 4, 6], "dspark": [1, 2, 3, 4, 5, 6]}[family]
    assert manifests["vllm"]["engine"]["ids"] == manifests["hf"]["engine"]["ids"] == ids
    assert [s["rows"] for s in manifests["vllm"]["shards"]] == [s["rows"] for s in manifests["hf"]["shards"]]
    assert len(manifests["vllm"]["shards"]) == 4 and manifests["vllm"]["rows"] == {"train": 24, "val": 3}
    worst = torch.zeros(len(TAPS[family]) + 1)
    for shard in manifests["vllm"]["shards"]:
        ours, reference = (load_file(str(folder / source / shard["shard"])) for source in ("vllm", "hf"))
        for name in ("input_ids", "loss_mask", "offsets", "row_ids"):
            assert torch.equal(ours[name], reference[name]), (shard["shard"], name)
        T, H = ours["hidden_states"].shape
        columns = [(ours[k].reshape(T, -1, H) - reference[k].reshape(T, -1, H)).abs().amax(dim=(0, 2))
                   for k in ("aux_hidden_states", "hidden_states")]  # fmt: skip
        worst = torch.maximum(worst, torch.cat(columns))
    print(f"{family}: max |vLLM - HF| per tap {TAPS[family]} and the final hidden: {worst.tolist()}")
    assert (worst <= ATOL).all(), worst.tolist()
    # the taps are in the draft's order, not the engine's: tap 3 (id 4) first for EAGLE-3
    spread = load_file(str(folder / "hf" / manifests["hf"]["shards"][0]["shard"]))["aux_hidden_states"]
    assert spread.abs().max() > 100 * ATOL


def _first_step(family: str, target: Path, features: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The family's first training step (loss and gradients) on the first batch of ``features``."""
    import lightning.pytorch as pl
    from eagle_helpers import eagle_module

    from lightning_eagle.run_settings import TargetSettings
    from lightning_eagle.training.dspark_anchors import anchor_generator
    from lightning_eagle.training.dspark_module import DSparkModule
    from lightning_eagle.training.dspark_settings import DSparkDraftSettings, DSparkObjectiveSettings

    torch.manual_seed(0)
    data = HiddenStateDataModule(str(features), batch_size=4)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    if family == "eagle3":
        module = eagle_module(target=str(target), aux_layer_ids=TAPS[family], target_source="features",
                              ttt_steps=2, draft={"intermediate_size": 64})  # fmt: skip
    else:
        settings = TargetSettings(path=str(target), aux_layer_ids=tuple(TAPS[family]), dtype="float32",
                                  source="features")  # fmt: skip
        module = DSparkModule(settings, DSparkDraftSettings(preset="k3-tiny"),
                              DSparkObjectiveSettings(num_anchors=16, loss_backend="plain"))  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(features.parent))  # fmt: skip
    trainer.datamodule = data  # the module reads the manifest through trainer.datamodule
    module._trainer = trainer
    torch.manual_seed(0)  # the same initial draft for both sources
    if family == "eagle3":
        module.configure_model(vocab_mapping=data.vocab_mapping)
        loss = module.shared_step(batch).loss
    else:
        module.configure_model()
        loss = module.shared_step(batch, anchor_generator(0, 0, 0))[0].loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in module.draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(TAPS))
def test_the_first_step_from_vllm_features_equals_the_step_from_hugging_face_features(extracted, engine_target,
                                                                                        family):  # fmt: skip
    folder = extracted["root"] / family
    loss_vllm, grads_vllm = _first_step(family, engine_target, folder / "vllm")
    loss_hf, grads_hf = _first_step(family, engine_target, folder / "hf")
    assert torch.isfinite(loss_hf) and loss_hf > 0
    torch.testing.assert_close(loss_vllm, loss_hf, rtol=1e-4, atol=1e-5)
    assert grads_vllm.keys() == grads_hf.keys() and grads_hf
    for name, grad in grads_hf.items():
        torch.testing.assert_close(grads_vllm[name], grad, rtol=1e-3, atol=1e-5, msg=name)


def test_the_cli_trains_both_families_from_vllm_features_offline_and_streaming(extracted):
    assert "extract complete" in extracted["eagle3_extract"] and "extract complete" in extracted["dspark_extract"]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in extracted["eagle3_fit"]
    streamed = extracted["dspark_streaming_fit"]
    assert f"`Trainer.fit` stopped: `max_steps={STREAMING_STEPS}` reached" in streamed
    assert "plan.json: the producer has not planned its shards yet" in streamed  # it started before the producer
    progress = json.loads((extracted["root"] / "dspark" / "vllm" / "producer.json").read_text())
    assert progress["state"] == "finished" and progress["vllm"] == "0.32.0"
