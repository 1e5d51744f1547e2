"""Fixtures of the engine tests: the vLLM venv, a draft trained by ``cli.py fit`` and written by ``cli.py export``, the
tiny DeepSeek-V3 target vLLM serves it with, and the probe runs (each one ``vllm.LLM`` in a subprocess of the engine
venv, run once per session; they are the slow part, about 20 s each)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from engine_helpers import AUX_IDS, PROMPTS, QUICKSTART_TARGET, REFERENCE_ROTARY, REPO, YARN, K, target_embedding
from safetensors.torch import load_file, save_file
from tiny_deepseek import write_tiny_deepseek_v3
from vllm_env import engine_python

from lightning_eagle.draft import Eagle3DraftConfig, build_draft, export_draft
from lightning_eagle.k3.loader import read_config

PROBE = Path(__file__).with_name("vllm_probe.py")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if os.environ.get("LIGHTNING_EAGLE_SKIP_ENGINE") == "1":
        if os.environ.get("CI"):
            raise RuntimeError("LIGHTNING_EAGLE_SKIP_ENGINE=1 is refused in CI: the engine tests must run there")
        pytest.skip("LIGHTNING_EAGLE_SKIP_ENGINE=1: the vLLM engine tests were skipped on request")
    return engine_python()  # a failed build raises with pip's output: loud, never a skip


def cli(*args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(REPO / "cli.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"cli.py {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def fit_and_export(root: Path, config: str, *overrides: str) -> Path:
    """``cli.py fit`` for a few steps on the quickstart target with K3's MLA latent (512 + rope 64: the head size
    vLLM's CPU decode kernel runs), then ``cli.py export``: what a user would serve."""
    cli(
        "fit", "--config", str(REPO / "configs" / config), "--trainer.default_root_dir", str(root),
        "--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--trainer.limit_val_batches", "1",
        "--model.draft.config.kv_lora_rank", "512", "--model.draft.config.qk_rope_head_dim", "64",
        "--model.target.aux_layer_ids", json.dumps(AUX_IDS), *overrides,
        cwd=root,
    )  # fmt: skip
    out = cli("export", str(root / "checkpoints" / "last.ckpt"), str(root / "served"), cwd=root)
    assert "engine setting the draft needs: VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0" in out
    return root / "served"


@pytest.fixture(scope="session")
def fitted_exports(tmp_path_factory) -> dict[str, Path]:
    """Both architectures trained and exported by the CLI, one after the other (two fits at once on 2 cores spin
    each other's OpenMP threads: measured 3x slower)."""
    runs = {
        # deepseek_mla: vLLM's own Eagle3DeepseekV2ForCausalLM, with DeepSeek YaRN
        "deepseek_mla": ("quickstart_deepseek_mla.yaml", "--model.draft.config.rope_scaling", json.dumps(YARN)),
        # the default K3-faithful draft (NoPE gated MLA + SiTU), served through our plugin
        "k3": ("quickstart.yaml",),
    }
    return {name: fit_and_export(tmp_path_factory.mktemp(f"fit_{name}"), *args) for name, args in runs.items()}


@pytest.fixture(scope="session")
def k3_shape_export(fitted_exports) -> Path:
    return fitted_exports["deepseek_mla"]


@pytest.fixture(scope="session")
def k3_draft_export(fitted_exports) -> Path:
    return fitted_exports["k3"]


@pytest.fixture(scope="session")
def plugin_site(vllm_python, tmp_path_factory) -> Path:
    """This checkout installed (no dependencies) into a folder on the engine's ``PYTHONPATH``: pip writes the
    ``vllm.general_plugins`` entry point from ``pyproject.toml``, as ``pip install "lightning_eagle[vllm]"`` does."""
    site = tmp_path_factory.mktemp("plugin_site")
    done = subprocess.run(
        [str(vllm_python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
         str(REPO)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"installing the plugin into the engine venv failed:\n{done.stderr[-3000:]}"
    return site


@pytest.fixture(scope="session")
def quickstart_shape_export(tmp_path_factory) -> Path:
    """The quickstart's deepseek_mla shape (latent 32 + rope 8): vLLM's CPU decode kernel cannot run its head size,
    so only the draft-extend pass over the prompt (SDPA prefill) is served, with one speculative token."""
    torch.manual_seed(5)
    config = Eagle3DraftConfig.from_target_config(
        read_config(QUICKSTART_TARGET.parent), architecture="deepseek_mla", intermediate_size=256, draft_vocab_size=320,
        aux_layer_ids=[1, 3, 5], aux_stream="prefix", fc_norm=True,
    )  # fmt: skip
    draft = build_draft(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        draft.set_vocab_mapping(torch.sort(torch.randperm(config.vocab_size)[: config.draft_vocab_size]).values)
    return export_draft(draft, tmp_path_factory.mktemp("quickstart_shape") / "served")


@pytest.fixture(scope="session")
def broken_exports(k3_shape_export, tmp_path_factory) -> dict[str, Path]:
    """Copies of the deepseek_mla export with one defect each, to see what vLLM's own code does with them."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for name in ("deepseek_v3_type", "extra_g_proj", "missing_up_proj"):
        folder = Path(shutil.copytree(k3_shape_export, root / name))
        weights = load_file(str(folder / "model.safetensors"))
        if name == "deepseek_v3_type":  # what we exported before issue 19
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
        elif name == "extra_g_proj":  # a K3 gate in an engine-named export
            o_proj = weights["layers.0.self_attn.o_proj.weight"]
            weights["layers.0.self_attn.g_proj.weight"] = torch.zeros(o_proj.shape[1], 2 * o_proj.shape[0])
            save_file(weights, str(folder / "model.safetensors"))
        else:
            del weights["layers.0.mlp.up_proj.weight"]
            save_file(weights, str(folder / "model.safetensors"))
        out[name] = folder
    return out


@pytest.fixture(scope="session")
def engine_target(tmp_path_factory) -> Path:
    return write_tiny_deepseek_v3(tmp_path_factory.mktemp("target") / "tiny-deepseek-v3", target_embedding(), 6)


class ProbeRun:
    """One ``vllm_probe.py`` run: ``result`` (its JSON) and ``captures`` (its tensors)."""

    def __init__(self, folder: Path):
        self.result = json.loads((folder / "result.json").read_text())
        captures = folder / "captures.safetensors"
        self.captures = load_file(str(captures)) if captures.exists() else {}


def probe(python: Path, folder: Path, plugin: Path | None = None, fails: bool = False, **request) -> ProbeRun | str:
    """Run ``vllm_probe.py``; ``plugin``: the folder with our installed package (on ``PYTHONPATH``). ``fails``: the
    run must fail; returns its log."""
    folder.mkdir(parents=True, exist_ok=True)
    request = {"out": str(folder), "env": {}, "compilation_config": REFERENCE_ROTARY, **request}
    (folder / "request.json").write_text(json.dumps(request))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default takes most of the machine's memory
    if plugin is not None:
        env["PYTHONPATH"] = str(plugin)
    done = subprocess.run(
        [str(python), str(PROBE), str(folder / "request.json")], capture_output=True, text=True, env=env, timeout=900
    )
    log = done.stdout + done.stderr
    (folder / "log.txt").write_text(log)
    if fails:
        assert done.returncode != 0, f"the vLLM probe was expected to fail (log: {folder / 'log.txt'})"
        return log
    assert done.returncode == 0, f"vLLM probe failed (log: {folder / 'log.txt'}):\n{done.stderr[-4000:]}"
    return ProbeRun(folder)


@pytest.fixture(scope="session")
def engine_runs(
    vllm_python,
    k3_shape_export,
    quickstart_shape_export,
    k3_draft_export,
    plugin_site,
    broken_exports,
    engine_target,
    tmp_path_factory,
) -> dict:
    """Every engine run the tests read, two at a time (each vLLM process keeps itself to one thread)."""
    root = tmp_path_factory.mktemp("engine")
    common = {"target": str(engine_target), "prompts": PROMPTS}
    runs = {
        "fp32": dict(draft=str(k3_shape_export), dtype="float32", num_speculative_tokens=K, max_tokens=16),
        "bf16": dict(draft=str(k3_shape_export), dtype="bfloat16", num_speculative_tokens=K, max_tokens=16),
        "plain": dict(draft=None, dtype="float32", num_speculative_tokens=0, max_tokens=16),
        "quickstart_fp32": dict(draft=str(quickstart_shape_export), dtype="float32", num_speculative_tokens=1,
                                max_tokens=1),
        "quickstart_bf16": dict(draft=str(quickstart_shape_export), dtype="bfloat16", num_speculative_tokens=1,
                                max_tokens=1),
        "k3_fp32": dict(draft=str(k3_draft_export), dtype="float32", num_speculative_tokens=K, max_tokens=16,
                        plugin=plugin_site),
        "k3_bf16": dict(draft=str(k3_draft_export), dtype="bfloat16", num_speculative_tokens=K, max_tokens=16,
                        plugin=plugin_site),
        "k3_without_plugin": dict(draft=str(k3_draft_export), dtype="float32", num_speculative_tokens=K,
                                  max_tokens=1, fails=True),
        "deepseek_v3_type": dict(draft=str(broken_exports["deepseek_v3_type"]), dtype="float32",
                                 num_speculative_tokens=1, max_tokens=1, fails=True),
        "extra_g_proj": dict(draft=str(broken_exports["extra_g_proj"]), dtype="float32", num_speculative_tokens=1,
                             max_tokens=1, fails=True),
        "missing_up_proj": dict(draft=str(broken_exports["missing_up_proj"]), dtype="float32",
                                num_speculative_tokens=1, max_tokens=1),
    }  # fmt: skip
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(probe, vllm_python, root / name, **common, **r) for name, r in runs.items()}
        return {name: future.result() for name, future in futures.items()}
