"""Runs inside the vLLM engine venv (never imported by the test process): serves a target with or without one of our
draft exports through ``vllm.LLM`` and records what vLLM's own code did.

    python vllm_probe.py REQUEST.json

``REQUEST.json``: ``{"target", "draft" (or null), "dtype", "num_speculative_tokens", "prompts" (token-id lists),
"max_tokens", "out", "env" (extra environment), "compilation_config" (or null)}``. Writes ``out/result.json`` and, with
a draft, ``out/captures.safetensors``:

* ``config``: what vLLM's ``SpeculativeConfig`` resolved (method, architectures, model_type, aux ids it captures);
* ``load``: every name vLLM's ``load_weights`` was handed, every draft parameter still NaN after loading (all are
  filled with NaN first) and after the proposer shared the target's embedding, whether it is the target's tensor, and
  ``draft_id_to_target_id``;
* ``draft.i.*``: the inputs and outputs of the i-th call of the draft's ``forward`` / ``combine_hidden_states`` /
  ``compute_logits``; ``target.layer.j``: the first output (``hidden + residual``) of target decoder layer j;
* ``tokens``: the greedy output per prompt; ``metrics``: vLLM's spec-decode counters.

Only vLLM's code runs the model: the probe wraps methods to record, it computes nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

request = json.loads(Path(sys.argv[1]).read_text())
os.environ.update(request.get("env") or {})
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the recording wrappers see the model

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.model_executor.models import deepseek_eagle3, deepseek_v2  # noqa: E402
from vllm.v1.spec_decode import llm_base_proposer  # noqa: E402

captures: dict[str, torch.Tensor] = {}
calls = {"forward": 0, "combine": 0, "logits": 0}
load: dict = {"names": [], "unset_after_load": [], "unset_after_share": []}
Draft = deepseek_eagle3.Eagle3DeepseekV2ForCausalLM


def keep(name: str, tensor: torch.Tensor) -> None:
    captures[name] = tensor.detach().to("cpu").clone().contiguous()


def unset(module: torch.nn.Module) -> list[str]:
    return sorted(n for n, p in module.named_parameters() if p.is_floating_point() and torch.isnan(p).any())


original_load = Draft.load_weights


def load_weights(self, weights):
    with torch.no_grad():
        for p in self.parameters():
            p.fill_(float("nan") if p.is_floating_point() else -(2**40))

    def recorded():
        for name, tensor in weights:
            load["names"].append(name)
            yield name, tensor

    result = original_load(self, recorded())
    load["returned"] = None if result is None else sorted(result)
    load["unset_after_load"] = unset(self)
    return result


original_proposer_load = llm_base_proposer.SpecDecodeBaseProposer.load_model


def proposer_load_model(self, target_model):
    original_proposer_load(self, target_model)
    load["unset_after_share"] = unset(self.model)
    target_embed = target_model.model.embed_tokens.weight
    draft_embed = self.model.model.embed_tokens.weight
    load["embedding_is_target"] = draft_embed.data_ptr() == target_embed.data_ptr()
    d2t = getattr(self.model, "draft_id_to_target_id", None)
    if d2t is not None:
        keep("load.draft_id_to_target_id", d2t)
    load["draft_class"] = type(self.model).__name__
    for name, module in self.model.named_modules():  # first call of each draft submodule, to localise a mismatch
        if name.count(".") <= 4 and name:
            module.register_forward_hook(first_call_hook(f"module.{name}"))


def first_call_hook(name: str):
    def hook(module, args, output):
        if f"{name}.out" in captures:
            return
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor):
            keep(f"{name}.out", out)
        if args and isinstance(args[0], torch.Tensor):
            keep(f"{name}.in", args[0])

    return hook


original_forward, original_combine, original_logits = Draft.forward, Draft.combine_hidden_states, Draft.compute_logits


def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
    i = calls["forward"]
    calls["forward"] += 1
    normed, carried = original_forward(self, input_ids, positions, hidden_states, inputs_embeds)
    for name, t in (("input_ids", input_ids), ("positions", positions), ("hidden_in", hidden_states)):
        keep(f"draft.{i}.{name}", t)
    keep(f"draft.{i}.normed", normed)
    keep(f"draft.{i}.carried", carried)
    return normed, carried


def one_tensor_recorder(original, tag: str, input_name: str):
    """Wrap a ``method(self, tensor) -> tensor``: record its i-th call's input and output as ``{tag}.{i}.*``."""

    def recorded(self, hidden_states):
        i = calls[tag]
        calls[tag] += 1
        out = original(self, hidden_states)
        keep(f"{tag}.{i}.{input_name}", hidden_states)
        keep(f"{tag}.{i}.out", out)
        return out

    return recorded


combine_hidden_states = one_tensor_recorder(original_combine, "combine", "aux")
compute_logits = one_tensor_recorder(original_logits, "logits", "hidden")


original_layer_forward = deepseek_v2.DeepseekV2DecoderLayer.forward


def layer_forward(self, positions, hidden_states, residual, *args, **kwargs):
    hidden, res = original_layer_forward(self, positions, hidden_states, residual, *args, **kwargs)
    name = f"target.layer.{self.layer_idx}"
    if name not in captures:  # the first call is the prompt's prefill
        keep(name, hidden + res)
        keep(f"{name}.positions", positions)
    return hidden, res


Draft.load_weights = load_weights
Draft.forward = forward
Draft.combine_hidden_states = combine_hidden_states
Draft.compute_logits = compute_logits
llm_base_proposer.SpecDecodeBaseProposer.load_model = proposer_load_model
deepseek_v2.DeepseekV2DecoderLayer.forward = layer_forward

spec = None
if request["draft"] is not None:
    spec = {
        "method": "eagle3",
        "model": request["draft"],
        "num_speculative_tokens": request["num_speculative_tokens"],
    }
kwargs = {}
if request.get("compilation_config") is not None:
    kwargs["compilation_config"] = request["compilation_config"]
llm = LLM(
    model=request["target"],
    skip_tokenizer_init=True,
    dtype=request["dtype"],
    max_model_len=512,
    max_num_seqs=4,
    max_num_batched_tokens=1024,
    speculative_config=spec,
    enforce_eager=True,
    disable_log_stats=False,
    seed=0,
    **kwargs,
)
result: dict = {}
vllm_config = llm.llm_engine.vllm_config
if spec is not None:
    sc = vllm_config.speculative_config
    hf = sc.draft_model_config.hf_config
    result["config"] = {
        "method": sc.method,
        "architectures": list(sc.draft_model_config.architectures),
        "model_type": hf.model_type,
        "num_speculative_tokens": sc.num_speculative_tokens,
    }
    result["load"] = load
outputs = llm.generate(
    [{"prompt_token_ids": list(p)} for p in request["prompts"]],
    SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True, detokenize=False),
    use_tqdm=False,
)
result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
metrics = {}
for metric in llm.get_metrics():
    if metric.name.startswith("vllm:spec_decode"):
        metrics[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
result["metrics"] = metrics
result["calls"] = calls
out = Path(request["out"])
out.mkdir(parents=True, exist_ok=True)
if captures:
    save_file(captures, str(out / "captures.safetensors"))
(out / "result.json").write_text(json.dumps(result, indent=1, default=str))
