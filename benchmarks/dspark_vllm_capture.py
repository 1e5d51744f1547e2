"""Runs in a Python with a CUDA build of vLLM (never imported by ``gpu_check.py``, which starts it as a subprocess):
serves the K3 target with one of our DSpark exports through ``vllm.LLM`` and records what vLLM's own
``K3DSparkForCausalLM`` computed in the first draft round of each prompt.

    python dspark_vllm_capture.py REQUEST.json

``REQUEST.json``: ``{"target", "draft", "num_speculative_tokens", "prompts" (token-id lists), "out",
"attention_backend" (or null)}``. Writes ``out/captures.safetensors``, per prompt ``i``:

* ``i.combine.in`` / ``i.combine.out``: the first ``combine_hidden_states`` call (concatenated target states in,
  ``context_norm(context_proj(·))`` out);
* ``i.context.states`` / ``i.context.positions``: the first ``precompute_and_store_context_kv`` call (the prompt's
  combined context, written into every layer's latent cache);
* ``i.block.input_ids`` / ``i.block.positions`` / ``i.block.out``: the first ``forward`` (the anchored block of
  ``num_speculative_tokens`` slots; its output after ``final_norm``).

Prompts are generated one at a time (one request per round: no batch segmentation to guess), eagerly (no CUDA graph
replays that would bypass the recording wrappers), with compilation off. Only vLLM computes; the wrappers copy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

request = json.loads(Path(sys.argv[1]).read_text())
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the wrappers see the model

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.models.kimi_k3.nvidia import dspark_mla  # noqa: E402

Draft = dspark_mla.K3DSparkForCausalLM
captures: dict[str, torch.Tensor] = {}
prompt = {"index": -1}


def keep(name: str, tensor: torch.Tensor) -> None:
    key = f"{prompt['index']}.{name}"
    if key not in captures:  # the first call of this prompt only
        captures[key] = tensor.detach().to("cpu").clone().contiguous()


original_combine, original_precompute, original_forward = (
    Draft.combine_hidden_states,
    Draft.precompute_and_store_context_kv,
    Draft.forward,
)


def combine_hidden_states(self, hidden_states):
    out = original_combine(self, hidden_states)
    keep("combine.in", hidden_states)
    keep("combine.out", out)
    return out


def precompute_and_store_context_kv(self, context_states, context_positions, context_slot_mapping=None):
    keep("context.states", context_states)
    keep("context.positions", context_positions)
    return original_precompute(self, context_states, context_positions, context_slot_mapping)


def forward(self, input_ids, positions, inputs_embeds=None):
    out = original_forward(self, input_ids, positions, inputs_embeds)
    if f"{prompt['index']}.context.states" in captures:  # the block that follows the prompt's context
        keep("block.input_ids", input_ids)
        keep("block.positions", positions)
        keep("block.out", out)
    return out


Draft.combine_hidden_states = combine_hidden_states
Draft.precompute_and_store_context_kv = precompute_and_store_context_kv
Draft.forward = forward

spec = {"method": "dspark", "model": request["draft"], "num_speculative_tokens": request["num_speculative_tokens"]}
if request.get("attention_backend"):
    spec["attention_backend"] = request["attention_backend"]
llm = LLM(
    model=request["target"],
    speculative_config=spec,
    dtype="bfloat16",
    enforce_eager=True,
    compilation_config={"mode": 0},
    max_model_len=512,
    gpu_memory_utilization=0.3,
    seed=0,
)
params = SamplingParams(temperature=0.0, max_tokens=8)
for i, ids in enumerate(request["prompts"]):
    prompt["index"] = i
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
out = Path(request["out"])
out.mkdir(parents=True, exist_ok=True)
save_file(captures, str(out / "captures.safetensors"))
