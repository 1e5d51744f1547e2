"""The extract worker's own refusals (``lightning_eagle.serving.extract_worker`` in the engine venv, started by
:class:`~lightning_eagle.features.engine_client.WorkerEngine`): a duplicate or unsorted id list (vLLM crashes on a
duplicate id), and on vLLM's CPU build a token budget below ``max_model_len`` (for an MLA target vLLM would hang on a
longer prompt), each with a clear error before vLLM is imported. What the worker extracts is proven through the
producer, against Hugging Face's forward of the same checkpoint, in ``test_vllm_extract.py``."""

from __future__ import annotations

import os
import time

import pytest
from engine_helpers import REFERENCE_ROTARY

from lightning_eagle.features.engine_client import EngineError, WorkerEngine

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "aux_ids, engine_args, message",
    [
        ([1, 3, 3, 6], {}, "list [3] more than once"),
        ([4, 1, 3], {}, "are not ascending"),
        ([1, 3, 4, 6], {"max_num_batched_tokens": 64}, "max_num_batched_tokens = 64 < max_model_len = 512"),
    ],
)
def test_the_worker_refuses_before_vllm_starts(vllm_python, engine_target, tmp_path, monkeypatch, aux_ids,
                                               engine_args, message):  # fmt: skip
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = {"model": str(engine_target), "aux_ids": aux_ids, "storage": str(tmp_path / "files"),
              "dtype": "float32", "max_model_len": 512, "cpu_connector": True, "env": {},
              "engine_args": {"compilation_config": REFERENCE_ROTARY, **engine_args}}  # fmt: skip
    start = time.monotonic()
    with pytest.raises(
        EngineError, match=f"the vLLM worker \\(log: .*\\): .*{message.replace('[', '.').replace(']', '.')}"
    ):
        WorkerEngine(config, log=tmp_path / "worker.log", python=str(vllm_python), start_timeout=120)
    assert "vllm" not in (tmp_path / "worker.log").read_text().lower()  # refused before importing vLLM
    assert time.monotonic() - start < 60
    assert not os.path.exists(tmp_path / "files") or not os.listdir(tmp_path / "files")
