"""A worker process holding one offline ``vllm.LLM`` that extracts a target's aux hidden states with vLLM's
``extract_hidden_states`` speculative method and its hidden-states KV connector. Run with the engine's interpreter
(this package on its ``PYTHONPATH``)::

    python -m lightning_eagle.serving.extract_worker CONFIG.json

``CONFIG.json``: ``model`` (the target's folder), ``aux_ids`` (vLLM's ids, ascending and unique: id 0 = the
embeddings, id k = the output of decoder layer k - 1, id ``num_hidden_layers`` = the final hidden before the final
norm), ``storage`` (the connector's ``shared_storage_path``), ``dtype``, ``max_model_len``, ``cpu_connector`` (true:
:class:`~lightning_eagle.serving.hidden_states_connector.CpuHiddenStatesConnector`, for vLLM's CPU build; false: the
stock ``ExampleHiddenStatesConnector``), ``engine_args`` (extra ``vllm.LLM`` keyword arguments) and ``env`` (set
into the environment before vLLM is imported).

Protocol, one JSON object per line; every line the worker sends starts with ``LIGHTNING_EAGLE_EXTRACT `` and goes to
its stdout, which carries nothing else (vLLM's own output, ours and its engine processes', is sent to stderr):

* first ``{"ready": true, "vllm": VERSION, "aux_ids": [...], "env": {...}}``, or ``{"error": ...}`` and exit code 1
  when the config is refused or the engine cannot be built;
* then per request line ``{"prompts": [[token ids], ...]}`` the answer ``{"paths": [...]}`` (absolute, in prompt
  order) or ``{"error": ...}``; an empty line or end of input stops the worker (exit code 0).

On vLLM's CPU build (``cpu_connector``) a ``max_num_batched_tokens`` below ``max_model_len`` is refused: for an MLA
target that build turns chunked prefill (and prefix caching) off in its engine process, after the scheduler's token
budget was set, and a longer prompt then waits forever.

Each path is vLLM's ``{storage}/{request id}.safetensors`` with ``hidden_states [T, n_ids, H]`` (the model dtype;
columns in ascending id order) and ``token_ids [T]`` (the prompt). A path is answered only once its file is complete:
the worker waits for the writer's lock as vLLM's ``load_hidden_states`` does, then removes the ``.lock`` file. The
files themselves are the caller's to delete.

The engine runs in its own process (vLLM's multiprocessing, spawned: hence the ``__main__`` guard): in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the writes wait for an engine step that never comes and the worker hangs.
Imports nothing of ``lightning_eagle`` besides naming the connector's module for vLLM to load.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

MARKER = "LIGHTNING_EAGLE_EXTRACT "
CPU_CONNECTOR_MODULE = "lightning_eagle.serving.hidden_states_connector"
WRITE_TIMEOUT_S = 600.0
REQUIRED = ("model", "aux_ids", "storage", "dtype", "max_model_len")


class Refused(ValueError):
    """A config or request the worker refuses (its message is sent back as the error)."""


def send(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(MARKER + json.dumps(message) + "\n")
    channel.flush()


def protocol_channel() -> TextIO:
    """The protocol's own copy of stdout; file descriptor 1 then points at stderr, so anything else written to stdout
    (vLLM's logs, its engine processes' output: they inherit descriptor 1) cannot break a protocol line."""
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return channel


def check_aux_ids(aux_ids: Any) -> list[int]:
    if not isinstance(aux_ids, list) or not aux_ids:
        raise Refused(f"aux_ids must be a non-empty list of layer ids, got {aux_ids!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in aux_ids):
        raise Refused(f"aux_ids must be non-negative integers, got {aux_ids!r}")
    duplicates = sorted({i for i in aux_ids if aux_ids.count(i) > 1})
    if duplicates:
        raise Refused(
            f"aux_ids {aux_ids} list {duplicates} more than once: vLLM's extract_hidden_states crashes on a duplicate "
            "id; list each id once"
        )
    if aux_ids != sorted(aux_ids):
        raise Refused(
            f"aux_ids {aux_ids} are not ascending: vLLM writes the columns in ascending id order whatever order the "
            f"config lists, so list them as {sorted(aux_ids)}"
        )
    return aux_ids


def read_config(path: str) -> dict[str, Any]:
    config = json.loads(Path(path).read_text())
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise Refused(f"{path} lacks {missing}")
    config["aux_ids"] = check_aux_ids(config["aux_ids"])
    for key in ("engine_args", "env"):
        if not isinstance(config.get(key) or {}, dict):
            raise Refused(f"{key} must be an object, got {config[key]!r}")
    batched = (config.get("engine_args") or {}).get("max_num_batched_tokens")
    if config.get("cpu_connector") and batched is not None and batched < int(config["max_model_len"]):
        raise Refused(
            f"max_num_batched_tokens = {batched} < max_model_len = {config['max_model_len']} on vLLM's CPU build: it "
            "turns chunked prefill off for an MLA target (DeepSeek, K3) after the token budget was fixed, and then "
            "never schedules a longer prompt (the worker would hang); leave max_num_batched_tokens unset"
        )
    if not all(isinstance(v, str) for v in (config.get("env") or {}).values()):
        raise Refused(f"env values must be strings, got {config['env']!r}")
    return config


def engine_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments: the target with the extract method and the hidden-states connector."""
    if config.get("cpu_connector"):
        connector = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": CPU_CONNECTOR_MODULE}
    else:
        connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    storage = str(Path(config["storage"]).resolve())
    kwargs = {
        "skip_tokenizer_init": True,  # prompts are token ids
        **(config.get("engine_args") or {}),
        "model": config["model"],
        "dtype": config["dtype"],
        "max_model_len": int(config["max_model_len"]),
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": config["aux_ids"]}},
        },
        "kv_transfer_config": {
            **connector,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        },
    }
    return kwargs


def check_prompts(request: Any) -> list[list[int]]:
    prompts = request.get("prompts") if isinstance(request, dict) else None
    if not isinstance(prompts, list) or not prompts:
        raise Refused(f'a request is {{"prompts": [[token ids], ...]}} with at least one prompt, got {request!r}')
    for p in prompts:
        if not isinstance(p, list) or not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise Refused(f"each prompt must be a non-empty list of token ids, got {p!r}")
    return prompts


def wait_written(path: str, deadline: float) -> None:
    """Wait until the connector's writer released ``path``'s lock (it holds it exclusively from before the path was
    returned until the file is written), then remove the lock file."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as handle:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"vLLM did not finish writing {path} in {WRITE_TIMEOUT_S:.0f} s") from None
                    time.sleep(0.01)
        os.remove(lock)
    if not os.path.isfile(path):
        raise RuntimeError(f"vLLM returned {path} but wrote no file there (see the engine's log for the writer)")


def extract(llm, prompts: list[list[int]]) -> list[str]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=1, detokenize=False),
        use_tqdm=False,
    )
    paths = []
    for prompt, output in zip(prompts, outputs, strict=True):
        params = output.kv_transfer_params or {}
        if "hidden_states_path" not in params:
            raise RuntimeError(f"vLLM returned no hidden_states_path for a prompt of {len(prompt)} tokens: {params}")
        paths.append(os.path.abspath(params["hidden_states_path"]))
    deadline = time.monotonic() + WRITE_TIMEOUT_S
    for path in paths:
        wait_written(path, deadline)
    return paths


def main(argv: list[str]) -> int:
    channel = protocol_channel()
    if len(argv) != 1:
        send(channel, {"error": "usage: python -m lightning_eagle.serving.extract_worker CONFIG.json"})
        return 1
    try:
        config = read_config(argv[0])
        env = {k: str(v) for k, v in (config.get("env") or {}).items()}
        os.environ.update(env)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            raise Refused("VLLM_ENABLE_V1_MULTIPROCESSING=0 hangs the hidden-states writes: leave it on")
        Path(config["storage"]).mkdir(parents=True, exist_ok=True)
        import vllm

        llm = vllm.LLM(**engine_kwargs(config))
    except Exception as error:  # noqa: BLE001 - every failure goes back to the caller as a protocol line
        send(channel, {"error": f"{type(error).__name__}: {error}"})
        return 1
    send(channel, {"ready": True, "vllm": vllm.__version__, "aux_ids": config["aux_ids"], "env": env})
    for line in sys.stdin:
        if not line.strip():
            break
        try:
            send(channel, {"paths": extract(llm, check_prompts(json.loads(line)))})
        except Exception as error:  # noqa: BLE001
            send(channel, {"error": f"{type(error).__name__}: {error}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
