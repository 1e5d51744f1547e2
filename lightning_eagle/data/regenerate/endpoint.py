"""The HTTP backend: any OpenAI-compatible chat-completions server, with bounded concurrency and retries."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from lightning_eagle.data.regenerate.engine import TurnJob, TurnResult
from lightning_eagle.data.regenerate.settings import RegenerateError, RegenerateSettings


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None, refused: bool = False) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.refused = refused  # nothing listening: worth retrying only once the server was reached


class EndpointEngine:
    """An OpenAI-compatible chat-completions server. Standard library only (urllib + a thread pool).

    Args:
        base_url: the API root, e.g. ``http://localhost:8000/v1`` (requests go to ``{base_url}/chat/completions``).
        model: the served model name; None = the first id of ``GET {base_url}/models``.
        max_concurrency: requests in flight at most.
        timeout: seconds per request (connect + response).
        max_retries: retries after the first attempt, on connection errors, timeouts, 5xx and 429.
        retry_backoff: first wait in seconds, doubled per retry (±25% jitter, capped at ``max_backoff``); a
            ``Retry-After`` header is honoured instead when present.
        extra_body: merged into every request (e.g. ``{"top_k": 20}``); it overrides what this engine sets.
    """

    def __init__(
        self,
        base_url: str,
        settings: RegenerateSettings,
        model: str | None = None,
        api_key: str | None = None,
        max_concurrency: int = 16,
        timeout: float = 600.0,
        max_retries: int = 6,
        retry_backoff: float = 1.0,
        max_backoff: float = 60.0,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be positive, got {max_concurrency}")
        if max_retries < 0 or timeout <= 0 or retry_backoff < 0:
            raise ValueError("max_retries must be >= 0, timeout > 0 and retry_backoff >= 0")
        self.base_url = base_url.rstrip("/")
        self.settings = settings
        self.api_key = api_key
        self.timeout, self.max_retries = timeout, max_retries
        self.retry_backoff, self.max_backoff = retry_backoff, max_backoff
        self.extra_body = dict(extra_body or {})
        self.capacity = max_concurrency
        self.retries = 0  # retried attempts, for the summary
        self._lock = threading.Lock()
        self._reached = False  # a refused connection before any answer fails at once (a wrong URL, no server)
        self.model = model or self._first_model()
        self._pool = cf.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="regenerate")
        self._futures: dict[cf.Future, TurnJob] = {}

    def describe(self) -> dict[str, Any]:
        # Not the URL: a server restarted elsewhere serving the same model may resume a run.
        return {"backend": "endpoint", "model": self.model, "extra_body": self.extra_body}

    # -- HTTP
    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One attempt. Raises :class:`_Retryable` for what a retry may fix, :class:`RegenerateError` otherwise."""
        data = None if body is None else json.dumps(body, ensure_ascii=False).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=self._headers(), method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace").strip()
            if exc.code == 429 or exc.code >= 500:
                raise _Retryable(f"HTTP {exc.code}: {detail}", _retry_after(exc.headers.get("Retry-After"))) from None
            raise RegenerateError(f"{method} {self.base_url}{path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
            refused = isinstance(exc, ConnectionRefusedError) or isinstance(getattr(exc, "reason", None),
                                                                            ConnectionRefusedError)  # fmt: skip
            raise _Retryable(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}", refused=refused) from None
        self._reached = True
        try:
            return json.loads(payload)
        except json.JSONDecodeError:
            raise _Retryable(f"response is not JSON: {payload[:100]!r}") from None

    def _with_retries(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        for attempt in range(self.max_retries + 1):
            try:
                return self._request(method, path, body)
            except _Retryable as exc:
                if exc.refused and not self._reached:
                    raise RegenerateError(
                        f"{method} {self.base_url}{path}: connection refused: nothing is listening there; is the "
                        "server running, and is --base-url right (e.g. http://localhost:8000/v1)?"
                    ) from None
                if attempt == self.max_retries:
                    raise RegenerateError(
                        f"{method} {self.base_url}{path} failed after {attempt + 1} attempt(s): {exc}"
                    ) from None
                with self._lock:
                    self.retries += 1
                wait = exc.retry_after
                if wait is None:
                    wait = min(self.max_backoff, self.retry_backoff * 2**attempt) * random.uniform(0.75, 1.25)
                wait = min(wait, self.max_backoff)
                print(f"regenerate: {method} {path}: {exc}; retry {attempt + 1}/{self.max_retries} in {wait:.1f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _first_model(self) -> str:
        listing = self._with_retries("GET", "/models")
        models = listing.get("data") if isinstance(listing, dict) else None
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise RegenerateError(f"GET {self.base_url}/models lists no model; pass --model")
        return str(models[0]["id"])

    # -- chat completions
    def request_body(self, job: TurnJob) -> dict[str, Any]:
        s = self.settings
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [_openai_message(m) for m in job.messages],
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "n": 1,
            "stream": False,
            # vLLM / SGLang pass these to the chat template (the K3 template's own keyword arguments).
            "chat_template_kwargs": dict(s.render_options),
        }
        if job.tools:
            body["tools"] = job.tools
        if job.seed is not None and s.temperature > 0:
            body["seed"] = job.seed
        body.update(self.extra_body)
        return body

    def _complete(self, job: TurnJob) -> TurnResult:
        response = self._with_retries("POST", "/chat/completions", self.request_body(job))
        try:
            choice = response["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise RegenerateError(f"unexpected chat-completions response: {json.dumps(response)[:200]}") from None
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            reasoning = message.get("reasoning")
        if self.settings.thinking and reasoning is None:
            # not "thought nothing" (that is ""): the server split no reasoning out, so the thinking is lost or
            # mixed into content; writing "" would be indistinguishable from an empty thought
            raise RegenerateError(
                "thinking is on but the server's answer has no reasoning_content: start it with its K3 reasoning "
                "parser (vLLM: --reasoning-parser kimi_k3) or regenerate with --no-thinking"
            )
        calls = message.get("tool_calls") or None
        content = message.get("content")
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        usage = response.get("usage") or {}
        return TurnResult(
            content=content if isinstance(content, str) else "",
            reasoning_content=(reasoning or "") if self.settings.thinking else None,
            tool_calls=calls,
            finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )

    def submit(self, job: TurnJob) -> None:
        self._futures[self._pool.submit(self._complete, job)] = job

    def poll(self) -> list[tuple[TurnJob, TurnResult | BaseException]]:
        if not self._futures:
            return []
        done, _ = cf.wait(list(self._futures), return_when=cf.FIRST_COMPLETED)
        out: list[tuple[TurnJob, TurnResult | BaseException]] = []
        for future in done:
            job = self._futures.pop(future)
            exc = future.exception()
            out.append((job, exc if exc is not None else future.result()))
        return out

    def close(self) -> None:
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)  # requests in flight finish in the background
        self._futures.clear()


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: use the backoff


def _openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """Our row message -> the OpenAI request form (tool-call arguments as JSON strings, ``type``/``id`` present)."""
    out = dict(message)
    if message.get("tool_calls"):
        calls = []
        for i, call in enumerate(message["tool_calls"]):
            function = dict(call.get("function", call))
            if not isinstance(function.get("arguments"), str):
                function["arguments"] = json.dumps(function.get("arguments") or {}, ensure_ascii=False)
            calls.append({"id": call.get("id", f"call_{i}"), "type": "function", "function": function})
        out["tool_calls"] = calls
    return out
