"""The serving engine a producer asks for hidden states (``engine_features.md``): vLLM with its
``extract_hidden_states`` method and hidden-states connector, reached two ways that give the same files:

* :class:`WorkerEngine` — an offline ``vllm.LLM`` the producer starts and stops itself, in a worker process of the
  engine's own interpreter (``lightning_eagle.serving.extract_worker``; vLLM's environment need not be ours);
* :class:`HttpEngine` — a running ``vllm serve`` (the operator's deployment), one completions request per row.

Both return, per prompt, the path of a ``{request id}.safetensors`` holding ``hidden_states [T, n_ids, H]`` (columns
in ascending id order) and ``token_ids [T]``, complete (the connector's ``.lock`` released); the caller reads it and
calls :meth:`FeatureEngine.release`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MARKER = "LIGHTNING_EAGLE_EXTRACT "  # the worker's protocol lines (lightning_eagle.serving.extract_worker)
WRITE_TIMEOUT_S = 600.0


class EngineError(RuntimeError):
    """The engine refused, failed or died; the message says which and where its log is."""


class FeatureEngine:
    """What a producer needs of an engine."""

    name = "vllm"
    version: str = "unknown"
    env: dict[str, str] = {}  # the settings the engine reports it runs with (empty: it reports none)
    where: str = "the engine"

    def capture(self, prompts: list[list[int]]) -> list[Path]:
        """One complete hidden-states file per prompt, in prompt order."""
        raise NotImplementedError

    def release(self, path: Path) -> None:
        """Remove a file :meth:`capture` returned (and its lock), once read."""
        for p in (path, Path(f"{path}.lock")):
            p.unlink(missing_ok=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> FeatureEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_written(path: Path, timeout: float = WRITE_TIMEOUT_S) -> None:
    """Block until the connector's writer released ``path``'s lock (held exclusively from before the path is answered
    until the file is written), as vLLM's own ``load_hidden_states`` does."""
    lock, deadline = Path(f"{path}.lock"), time.monotonic() + timeout
    while True:
        if lock.exists():
            with contextlib.suppress(FileNotFoundError), open(lock) as handle:
                fcntl.flock(handle, fcntl.LOCK_SH)  # waits for the writer
                fcntl.flock(handle, fcntl.LOCK_UN)
        if path.is_file() and not _locked(lock):
            return
        if time.monotonic() > deadline:
            raise EngineError(f"{path}: the engine answered this path but wrote no file within {timeout:.0f} s")
        time.sleep(0.05)


def _locked(lock: Path) -> bool:
    try:
        with open(lock) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
    except FileNotFoundError:
        pass
    return False


class WorkerEngine(FeatureEngine):
    """An offline ``vllm.LLM`` in a worker process of ``python`` (default: this interpreter), this package on its
    ``PYTHONPATH``. ``config``: the worker's (``model``, ``aux_ids``, ``storage``, ``dtype``, ``max_model_len``,
    ``cpu_connector``, ``engine_args``, ``env``); its log goes to ``log``. ``worker``: the program after the
    interpreter (default: ``-m lightning_eagle.serving.extract_worker``; a reference speaking the same protocol, e.g.
    the engine tests' Hugging Face worker, can stand in)."""

    WORKER = ("-m", "lightning_eagle.serving.extract_worker")

    def __init__(self, config: dict[str, Any], log: Path, python: str | None = None, start_timeout: float = 1800.0,
                 worker: Sequence[str] = WORKER):  # fmt: skip
        self.log_path, self.where = Path(log), f"the vLLM worker (log: {log})"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        handle, config_path = tempfile.mkstemp(prefix="extract-worker-", suffix=".json")
        with os.fdopen(handle, "w") as f:
            json.dump(config, f)
        package_root = str(Path(__file__).resolve().parents[2])
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [python or sys.executable, *worker, config_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True,
            start_new_session=True,  # its engine processes are stopped with it
        )  # fmt: skip
        try:
            ready = self._receive(start_timeout)
        except BaseException:
            self._kill()  # a refused, failed or stuck start leaves no process behind
            raise
        finally:
            os.unlink(config_path)
        self.version, self.env = str(ready.get("vllm", "unknown")), dict(ready.get("env") or {})

    def _receive(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                self.process.wait(timeout=30)
                raise EngineError(f"{self.where} exited (code {self.process.returncode}): {self._log_tail()}")
            if line.startswith(MARKER):
                message = json.loads(line[len(MARKER) :])
                if "error" in message:
                    raise EngineError(f"{self.where}: {message['error']}")
                return message
        raise EngineError(f"{self.where} did not answer within {timeout:.0f} s")

    def _log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def capture(self, prompts: list[list[int]]) -> list[Path]:
        try:
            self.process.stdin.write(json.dumps({"prompts": prompts}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise EngineError(f"{self.where} is gone: {self._log_tail()}") from None
        paths = [Path(p) for p in self._receive(WRITE_TIMEOUT_S)["paths"]]
        if len(paths) != len(prompts):
            raise EngineError(f"{self.where} answered {len(paths)} paths for {len(prompts)} prompts")
        return paths

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.process.stdin.write("\n")
                self.process.stdin.flush()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._kill()
        self._log.close()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the worker's session: vLLM's engine processes too
        self.process.wait()
        self._log.close()


class HttpEngine(FeatureEngine):
    """A running ``vllm serve`` at ``url`` whose connector writes into a folder this machine reads (the path in each
    response). One prompt per request (vLLM 0.32 answers only the first path of a batched prompt), ``concurrency`` in
    flight. ``env``: what the operator declares the server runs with, unless the server reports it itself
    (``/server_info``, available with ``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, url: str, concurrency: int = 8, env: dict[str, str] | None = None, timeout: float = 600.0):
        self.url, self.timeout, self.where = url.rstrip("/"), timeout, f"vllm serve at {url}"
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="extract-http")
        self.version = str(self._get("/version").get("version", "unknown"))
        models = self._get("/v1/models").get("data") or []
        if not models:
            raise EngineError(f"{self.where} serves no model (/v1/models is empty)")
        self.model = models[0]["id"]
        self.env = dict(env or {})
        with contextlib.suppress(EngineError):
            reported = self._get("/server_info?config_format=json").get("vllm_env") or {}
            self.env.update({k: _env_text(v) for k, v in reported.items() if k.startswith("VLLM_KIMI_K3_")})
            self.reports_env = True

    reports_env = False

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise EngineError(f"{self.where}{path}: HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise EngineError(f"{self.where}{path}: {err}") from None

    def _get(self, path: str) -> dict[str, Any]:
        return self._request(path)

    def _one(self, prompt: list[int]) -> Path:
        answer = self._request("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1})
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise EngineError(
                f"{self.where} answered without kv_transfer_params.hidden_states_path: is it served with "
                "--speculative-config method extract_hidden_states and a hidden-states --kv-transfer-config?"
            )
        path = Path(path)
        wait_written(path)
        return path

    def capture(self, prompts: list[list[int]]) -> list[Path]:
        return list(self.pool.map(self._one, prompts))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
