"""Our taps in a serving engine's numbering, converted in one place (``engine_features.md``, "Numbering").

vLLM's ``extract_hidden_states`` numbers what it captures by *layer boundary*: id 0 = the embeddings, id k (0 < k < L)
= the output of decoder layer k − 1, id L = the final hidden **before** the final norm. Our taps are 0-based layer
outputs, so tap j is id j + 1, and the teacher's final hidden is id L:

    ids = sorted({j + 1 for j in taps} ∪ {L})          (the engine's file columns come back in this order)

On Kimi K3 the ids read one AttnRes stream, chosen by the engine's ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM`` (0: our
``prefix`` stream, 1: ``mixed``), which must be the stream the draft trains on and the stream its export names. Under
stream 0, vLLM 0.32's id L is only the open AttnRes block's partial sum, not the model's output ("Kimi K3"): a teacher
built from it is wrong, so that combination is refused before an engine starts.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from lightning_eagle.k3.target_spec import TargetSpec

STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
STREAM_ENV_VALUES = {"prefix": "0", "mixed": "1"}  # our aux_stream -> the engine's setting
FINAL_ID_FIX = "vLLM PR #50815"  # makes id L the model's output under stream 0; not in vLLM 0.32


@dataclasses.dataclass(frozen=True)
class EngineCapture:
    """What to ask a vLLM engine for, and where our tensors are in what it returns.

    Args:
        ids: the engine's ``eagle_aux_hidden_state_layer_ids`` (sorted, unique: its file columns).
        tap_columns: the column of each of our taps, in the draft's tap order.
        final_column: the column of the pre-norm final hidden (id L).
        env: the engine settings the capture depends on (K3: the AttnRes stream).
        stream: our ``aux_stream`` the ids read.
    """

    ids: tuple[int, ...]
    tap_columns: tuple[int, ...]
    final_column: int
    env: dict[str, str]
    stream: str

    def record(self) -> dict:
        return {"ids": list(self.ids), "tap_columns": list(self.tap_columns), "final_column": self.final_column,
                "env": dict(self.env), "stream": self.stream}  # fmt: skip


def engine_ids(taps: Sequence[int], num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``(ids, tap_columns, final_column)`` of 0-based ``taps`` on a model of ``num_layers`` decoder layers.
    A repeated or out-of-range tap is refused by name (the engine would crash on a repeated id)."""
    taps = [int(t) for t in taps]
    if not taps:
        raise ValueError("no taps to extract: model.target.aux_layer_ids is empty")
    repeated = sorted({t for t in taps if taps.count(t) > 1})
    if repeated:
        raise ValueError(f"model.target.aux_layer_ids {taps} lists layer(s) {repeated} more than once")
    outside = [t for t in taps if not 0 <= t < num_layers]
    if outside:
        raise ValueError(
            f"model.target.aux_layer_ids {taps}: layer(s) {outside} are outside the target's {num_layers} layers "
            f"(0-based layer outputs: 0..{num_layers - 1})"
        )
    ids = tuple(sorted({t + 1 for t in taps} | {num_layers}))
    return ids, tuple(ids.index(t + 1) for t in taps), ids.index(num_layers)


def engine_capture(spec: TargetSpec, final_id_is_output: bool = False) -> EngineCapture:
    """The capture of ``spec``'s taps and final hidden. On K3 the stream decides the engine setting, and stream
    ``prefix`` is refused unless the engine is declared to carry the fix (``final_id_is_output``)."""
    ids, columns, final = engine_ids(spec.aux_layer_ids, spec.num_layers)
    env: dict[str, str] = {}
    if spec.is_k3:
        env[STREAM_ENV] = STREAM_ENV_VALUES[spec.aux_stream]
        if spec.aux_stream == "prefix" and not final_id_is_output:
            raise ValueError(
                f"model.target.aux_stream 'prefix' extracts with {STREAM_ENV}=0, where vLLM 0.32's id "
                f"{spec.num_layers} (the final hidden the teacher is built from) is only the open AttnRes block's "
                "partial sum, not the model's output: every teacher logit would be wrong. Fix: train on the mixed "
                f"stream (model.target.aux_stream: mixed; the engine then runs with {STREAM_ENV}=1 and the export "
                f"names it), or, with a vLLM that has {FINAL_ID_FIX}, pass --final-id-is-output"
            )
    return EngineCapture(ids, columns, final, env, spec.aux_stream)


def check_engine_env(capture: EngineCapture, engine_env: dict[str, str], where: str) -> None:
    """The engine's reported settings must be the ones the capture depends on (a stream the draft does not train on
    would give features of another stream under the same ids)."""
    for name, value in capture.env.items():
        got = engine_env.get(name)
        if got is None:
            raise ValueError(
                f"cannot tell which stream {where} captures ({name} is not reported): start it with "
                f"VLLM_SERVER_DEV_MODE=1 (it then reports its settings at /server_info) or declare what it runs with: "
                f"--served-env {name}={value}"
            )
        if got != value:
            raise ValueError(
                f"{where} runs with {name}={got}, this run trains on the {capture.stream!r} stream ({name}={value}): "
                "restart the engine with the run's setting, or set model.target.aux_stream to the engine's"
            )


def serve_command(capture: EngineCapture, model: str, storage: str, cpu_connector: bool = False) -> str:
    """The ``vllm serve`` line that extracts what ``capture`` asks (the server ``cli.py extract --vllm-url`` reads)."""
    draft = {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(capture.ids)}}
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config": draft}
    connector = (
        {"kv_connector": "CpuHiddenStatesConnector",
         "kv_connector_module_path": "lightning_eagle.serving.hidden_states_connector"}
        if cpu_connector else {"kv_connector": "ExampleHiddenStatesConnector"}
    )  # fmt: skip
    transfer = {**connector, "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": storage}}
    env = "".join(f"{k}={v} " for k, v in capture.env.items())
    return (f"{env}VLLM_SERVER_DEV_MODE=1 vllm serve {model} --speculative-config '{json.dumps(speculative)}' "
            f"--kv-transfer-config '{json.dumps(transfer)}'")  # fmt: skip
