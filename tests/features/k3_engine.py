"""vLLM's hidden-states contract computed by our own K3 (``features.own_engine``; the mixed stream: id k = the output
of layer k - 1, id L = the pre-norm final hidden), for producer tests that need no vLLM: in-process
(:class:`OurK3Engine`) and behind the HTTP endpoints ``HttpEngine`` reads (:class:`FakeVllmServer`: ``/version``,
``/v1/models``, ``/server_info``, ``/v1/completions`` answering ``kv_transfer_params.hidden_states_path``)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from lightning_eagle.features.own_engine import OwnTargetEngine
from lightning_eagle.k3.model import KimiK3ForCausalLM


class OurK3Engine(OwnTargetEngine):
    """The quickstart K3 writing vLLM's files for ``ids`` into ``storage`` (stream mixed, as ``=1`` would)."""

    def __init__(self, ids, storage: Path, version: str = "test") -> None:
        super().__init__(KimiK3ForCausalLM.from_pretrained("quickstart", dtype=torch.float32), ids, storage,
                         version=version)  # fmt: skip


class FakeVllmServer:
    """A ``vllm serve`` stand-in on 127.0.0.1 serving :class:`OurK3Engine`'s files. ``reported_env``: what
    ``/server_info`` reports (None: the endpoint is absent, as without ``VLLM_SERVER_DEV_MODE=1``).
    ``on_request(n)``: called before the n-th completion (1-based) is answered."""

    def __init__(self, engine: OurK3Engine, reported_env: dict | None = None,
                 on_request: Callable[[int], None] | None = None) -> None:  # fmt: skip
        self.engine, self.requests = engine, 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

            def log_message(self, *args) -> None:
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client killed on purpose
                    self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/version":
                    return self._answer(200, {"version": engine.version})
                if self.path == "/v1/models":
                    return self._answer(200, {"data": [{"id": "k3-tiny"}]})
                if self.path.startswith("/server_info") and reported_env is not None:
                    return self._answer(200, {"vllm_env": reported_env})
                return self._answer(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with engine.lock:
                    server.requests += 1
                    n = server.requests
                if on_request is not None:
                    on_request(n)
                path = engine.write(body["prompt"])
                return self._answer(200, {"choices": [{"text": ""}],
                                          "kv_transfer_params": {"hidden_states_path": str(path)}})  # fmt: skip

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def __enter__(self) -> FakeVllmServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()
