"""Runs inside the vLLM engine venv (never imported by the test process): hands one of our DSpark exports to vLLM's
own config, speculative config, model registry, model class and loader, and records what they did.

    python vllm_dspark_probe.py REQUEST.json

``REQUEST.json``: ``{"draft", "target", "num_speculative_tokens", "out", "inputs" (a safetensors file or null),
"refusals" (name -> config changes; ``result["refusals"][name]`` is vLLM's error, or null when it accepted)}``.
Writes ``out/result.json``, ``out/loaded.safetensors`` (every parameter of vLLM's ``K3DSparkForCausalLM`` after its
``load_weights``) and ``out/computed.safetensors`` (what the loaded model's own pieces compute on ``inputs``:
``combine_hidden_states``, layer 0's rotary (``forward_native``), ``KimiMLP`` and input norm, ``markov_embed`` /
``markov_bias``, ``compute_confidence``; ``result["softmax_scale"]``: its MLA's softmax scale):

* ``config``: what ``K3DSparkConfig`` parsed from the export (``rope_parameters``, taps, sizes);
* ``spec``: what ``SpeculativeConfig(method="dspark")`` resolved: method, architectures, config class, the aux layer
  ids the runner captures (``get_eagle3_aux_layers_from_config``), the mask id (``get_parallel_drafting_token_id``),
  the class the registry resolves;
* ``load``: every name ``load_weights`` was handed, what it returned, every parameter still NaN after loading (all
  are filled with NaN first).

On this CPU build vLLM refuses to *run* DSpark (``VllmConfig``: "Model Runner V1 does not support: dspark
speculative decoding"), so the probe builds a default ``VllmConfig`` and attaches the target's ``ModelConfig`` and
the resolved ``SpeculativeConfig``: what ``K3DSparkForCausalLM.__init__`` reads. Only vLLM's code builds and loads.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

request = json.loads(Path(sys.argv[1]).read_text())
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from vllm.config import (  # noqa: E402
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.model_executor.models import ModelRegistry  # noqa: E402
from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id  # noqa: E402

out = Path(request["out"])
out.mkdir(parents=True, exist_ok=True)
draft = Path(request["draft"])
result: dict = {}

parsed = K3DSparkConfig(**json.loads((draft / "config.json").read_text()))
result["config"] = {
    name: getattr(parsed, name)
    for name in (
        "rope_parameters", "target_layer_ids", "num_target_layers", "vocab_size", "draft_vocab_size", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_size", "intermediate_size",
        "num_hidden_layers", "num_attention_heads", "markov_rank", "target_hidden_size", "block_size",
        "n_routed_experts", "hidden_act", "sample_from_anchor", "mask_token_id", "enable_confidence_head",
        "confidence_head_with_markov",
    )
}  # fmt: skip

# vLLM's refusals of mutated copies of the exported config (request["refusals"]: name -> field changes)
result["refusals"] = {}
for name, changes in (request.get("refusals") or {}).items():
    try:
        K3DSparkConfig(**{**json.loads((draft / "config.json").read_text()), **changes})
        result["refusals"][name] = None
    except ValueError as error:
        result["refusals"][name] = str(error)

target = ModelConfig(model=request["target"], dtype="bfloat16", max_model_len=256)
tokens = (
    {} if request["num_speculative_tokens"] is None else {"num_speculative_tokens": request["num_speculative_tokens"]}
)
spec = SpeculativeConfig(
    method="dspark", model=str(draft), target_model_config=target, target_parallel_config=ParallelConfig(), **tokens
)
draft_config = spec.draft_model_config
model_cls, arch = ModelRegistry.resolve_model_cls(draft_config.architectures, draft_config)
result["spec"] = {
    "method": spec.method,
    "num_speculative_tokens": spec.num_speculative_tokens,
    "architectures": list(draft_config.architectures),
    "config_class": type(draft_config.hf_config).__name__,
    "model_type": draft_config.hf_config.model_type,
    "aux_layer_ids": list(get_eagle3_aux_layers_from_config(spec) or []),
    "mask_token_id": get_parallel_drafting_token_id(draft_config.hf_config),
    "resolved_arch": arch,
    "resolved_class": f"{model_cls.__module__}.{model_cls.__qualname__}",
    "parallel_drafting": spec.parallel_drafting,
}

vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
object.__setattr__(vllm_config, "model_config", target)
object.__setattr__(vllm_config, "speculative_config", spec)
torch.set_default_dtype(torch.bfloat16)
with set_current_vllm_config(vllm_config):
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{tempfile.mktemp()}", backend="gloo"
    )
    initialize_model_parallel(1, 1)
    model = model_cls(vllm_config=vllm_config, prefix="")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    names: list[str] = []

    def weights():
        for name, tensor in load_file(str(draft / "model.safetensors")).items():
            names.append(name)
            yield name, tensor

    returned = model.load_weights(weights())
    loaded = {n: p.detach().contiguous().clone() for n, p in model.named_parameters()}
    unset = sorted(n for n, p in model.named_parameters() if torch.isnan(p).any())
    # What vLLM's loader does next for the linears these pieces use (its CPU linears need it). Not the attention's:
    # on this CPU build its generic pass empties kv_b_proj before the MLA layer's own pass reads it.
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and ".self_attn" not in module_name and "context_kv_proj" not in module_name:
            method.process_weights_after_loading(module)
    computed = {}
    if request.get("inputs"):
        x = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(request["inputs"]).items()}
        layer = model.model.layers[0]
        computed["combine"] = model.combine_hidden_states(x["features"])
        q, k = x["q_pe"].clone(), x["k_pe"].clone()
        computed["rotary_q"], computed["rotary_k"] = layer.self_attn.rotary_emb.forward_native(x["positions"], q, k)
        computed["mlp"] = layer.mlp(x["hidden"])
        computed["input_layernorm"] = layer.input_layernorm.forward_native(x["hidden"])
        markov = model.markov_embed(x["tokens"])
        computed["markov_embed"] = markov
        computed["markov_bias"] = model.markov_bias(markov)
        if model.model.confidence_head is not None:
            computed["confidence"] = model.compute_confidence(x["hidden"], markov)
        result["softmax_scale"] = layer.self_attn.scale
result["load"] = {
    "names": names,
    "returned": None if returned is None else sorted(returned),
    "unset": unset,
    "dtypes": {n: str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()},
}
save_file(loaded, str(out / "loaded.safetensors"))
save_file({k: v.detach().contiguous() for k, v in computed.items()}, str(out / "computed.safetensors"))
(out / "result.json").write_text(json.dumps(result, indent=2, default=str))
