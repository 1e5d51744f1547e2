"""Regenerate the assistant turns of a chat file with the target itself: EAGLE drafts train best on the target's own
responses (its distribution, its formatting, its reasoning length).

``regenerate INPUT OUTPUT (--target PATH|quickstart | --base-url URL) [options]`` reads a chat file (our
``{"messages": [...]}`` JSONL/JSON rows, validated with the data pipeline's reader so errors name ``file:line``)
and writes a JSONL where every assistant turn is the target's response to the conversation before it:

* ``context="generated"`` (default): turn k is answered after the *regenerated* turns before it, so every assistant
  turn of an output row is what the target says to exactly the context that row renders (turns of one row run in
  sequence; rows run concurrently). ``"original"`` answers every turn after the input's own earlier turns (all
  turns of a row run concurrently; the output then mixes contexts).
* Assistant turns that carry ``tool_calls`` are kept verbatim (their tool results follow them in the row); so is an
  assistant turn with nothing before it. Other messages, the row's other keys (``id``, ``tools``, ...) and the
  assistant messages' other keys are kept.
* With ``thinking`` on, the prompt opens the K3 ``think`` channel and the generated thinking goes to
  ``reasoning_content``; off, the prompt opens ``response`` and there is no ``reasoning_content``. ``thinking`` /
  ``thinking_effort`` must be the render options the draft is trained with.
* Sampling: greedy at ``temperature=0``; else temperature / ``top_p`` with one seed per turn derived from
  ``seed``, the row number and the turn index, so a row's output does not depend on batching, concurrency or resume.

Backends:

* :class:`LocalEngine`: our in-library target (``KimiK3ForCausalLM.from_pretrained(path or "quickstart")``) with
  continuous batched incremental decoding (:class:`~lightning_eagle.inference.batched.BatchedGenerator`), CPU or
  GPU; prompts are rendered with the K3 template plus generation prompt, decoding stops at ``<|end_of_msg|>`` or
  ``max_new_tokens``, and the tokens are split into the message fields by :func:`split_k3_response`.
* :class:`EndpointEngine`: any OpenAI-compatible ``POST {base_url}/chat/completions`` (vLLM / SGLang serving the real
  K3 with its reasoning parser), standard library only: at most ``max_concurrency`` requests in flight, retries with
  exponential backoff (and ``Retry-After``) on connection errors, timeouts, 5xx and 429, a per-request timeout.

Resumable: each finished row is appended (and flushed) to ``OUTPUT.progress`` keyed by its input row number, after a
header recording the input's hash and every setting that changes the output. A killed run, started again with the
same command, skips the rows already there (a torn last line is discarded and regenerated); at the end the rows are
merged in input order into OUTPUT, written atomically, and the progress file is removed. Every input row appears
exactly once (minus rows skipped as malformed or dropped after failing, both counted).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import http.client
import json
import os
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lightning_eagle.atomic import atomic_file
from lightning_eagle.data.formats import TOO_DEEP
from lightning_eagle.data.render_k3 import (
    CLOSE,
    END_OF_MSG,
    OPEN,
    SEP,
    THINKING_EFFORTS,
    ChatFormatError,
    build_k3_segments,
)
from lightning_eagle.data.rows import DataRowError, RowProblem, iter_raw_rows, validate_row

PROGRESS_FORMAT = "lightning_eagle.regenerate_progress/1"
CONTEXTS = ("generated", "original")
DEBUG_ENV = "LIGHTNING_EAGLE_DEBUG"


class RegenerateError(ValueError):
    """A turn that could not be generated (request failed after its retries, or the server refused it)."""


# ---- settings, rows, turns -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegenerateSettings:
    """Everything that changes the generated rows (recorded in the progress header; a resume must match)."""

    max_new_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    thinking: bool = True
    thinking_effort: str | None = "max"
    context: str = "generated"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of {list(CONTEXTS)}, got {self.context!r}")
        if self.thinking and self.thinking_effort is not None and self.thinking_effort not in THINKING_EFFORTS:
            raise ValueError(
                f"thinking_effort must be one of {list(THINKING_EFFORTS)} or None, got {self.thinking_effort!r}"
            )

    @property
    def render_options(self) -> dict[str, Any]:
        return {"thinking": self.thinking, "thinking_effort": self.thinking_effort}

    def turn_seed(self, row: int, turn: int) -> int | None:
        """The seed of one turn: a function of (seed, row, turn) only; None when ``seed`` is None."""
        if self.seed is None:
            return None
        digest = hashlib.sha256(f"{self.seed}/{row}/{turn}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 2  # < 2**62: fits torch and every server's seed field


@dataclass(frozen=True)
class InputRow:
    index: int  # 0-based position among the input's rows (the progress key)
    file: str
    line: int
    data: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class TurnJob:
    """One assistant turn to generate: the messages before it (and the row's tools)."""

    row: int
    turn: int  # index of the assistant message in the row
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    seed: int | None


@dataclass
class TurnResult:
    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"  # "stop" or "length"
    completion_tokens: int = 0

    def message(self, original: dict[str, Any], thinking: bool) -> dict[str, Any]:
        """The new assistant message: the original's other keys, the generated fields."""
        drop = ("content", "reasoning_content", "reasoning", "tool_calls")
        out = {k: v for k, v in original.items() if k not in drop}
        out["role"] = "assistant"
        out["content"] = self.content
        if thinking and self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def turns_to_regenerate(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of the assistant turns to replace: all but tool-calling ones and one with nothing before it."""
    return [i for i, m in enumerate(messages) if i > 0 and m.get("role") == "assistant" and not m.get("tool_calls")]


def read_input_rows(
    path: str | Path, settings: RegenerateSettings, on_bad_row: str = "raise"
) -> tuple[list[InputRow], list[str]]:
    """Read and validate every row (``file:line: field: problem`` errors). Returns the chat rows and, with
    ``on_bad_row="skip"``, the messages of the skipped ones. Pre-tokenized rows cannot be regenerated (bad)."""
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input chat file {str(path)!r} does not exist")
    rows: list[InputRow] = []
    bad: list[str] = []
    for index, raw in enumerate(iter_raw_rows(path)):
        error = raw if isinstance(raw, DataRowError) else None
        if error is None:
            try:
                if validate_row(raw.data, 2**62) != "chat":
                    raise RowProblem("messages", "pre-tokenized rows cannot be regenerated (a 'messages' row needed)")
                # Render once now: problems only the template finds (tool names, options) fail here, not mid-run.
                build_k3_segments(raw.data["messages"], raw.data.get("tools"), **settings.render_options)
            except RowProblem as exc:
                error = DataRowError(raw.file, raw.line, exc.field, exc.problem)
            except ChatFormatError as exc:
                field_name, _, problem = str(exc).partition(": ")
                error = DataRowError(raw.file, raw.line, field_name, problem or str(exc))
            except RecursionError:
                error = DataRowError(raw.file, raw.line, "<json>", TOO_DEEP)
        if error is not None:
            if on_bad_row == "raise":
                raise DataRowError(error.file, error.line, error.field, error.problem, "--on-bad-row skip skips it")
            bad.append(str(error))
            continue
        rows.append(InputRow(index, raw.file, raw.line, raw.data))
    return rows, bad


# ---- splitting a K3 generation into message fields -------------------------------------------------------------------
_ATTR = re.compile(r'\s([\w-]+)="([^"]*)"')


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


@dataclass
class ParsedResponse:
    reasoning_content: str | None
    content: str
    tool_calls: list[dict[str, Any]] | None
    well_formed: bool  # every tag closed in order and the message closed before the end


def split_k3_response(token_ids: Sequence[int], tokenizer: Any, thinking: bool) -> ParsedResponse:
    """Split the tokens generated after the K3 generation prompt into ``reasoning_content`` / ``content`` /
    ``tool_calls`` — the inverse of how :mod:`lightning_eagle.data.render_k3` renders an assistant body.

    Works on token ids, not text: the XTML markers are special tokens, and marker text typed inside content was
    encoded as ordinary bytes, so the structure cannot be faked by the content. The generation prompt already opened
    ``think`` (thinking on) or ``response``; everything up to ``<|end_of_msg|>`` is parsed leniently (a generation
    cut by ``max_new_tokens`` keeps what it has; text outside any channel is dropped and ``well_formed`` is False).
    """
    ids_of = tokenizer.special_tokens
    try:
        open_id, close_id, sep_id = ids_of[OPEN], ids_of[CLOSE], ids_of[SEP]
    except KeyError as exc:
        raise ValueError(f"tokenizer {tokenizer!r} has no K3 XTML marker {exc.args[0]!r}") from None
    eom_id = ids_of.get(END_OF_MSG)
    ids = [int(t) for t in token_ids]
    if eom_id in ids:
        ids = ids[: ids.index(eom_id)]

    events: list[tuple[str, str]] = []  # ("text", s) | ("open", tag) | ("close", tag)
    well_formed = True
    run: list[int] = []

    def flush() -> None:
        if run:
            events.append(("text", tokenizer.decode(run)))
            run.clear()

    i = 0
    while i < len(ids):
        t = ids[i]
        if t in (open_id, close_id):
            j = i + 1
            while j < len(ids) and ids[j] not in (open_id, close_id, sep_id):
                j += 1
            flush()
            if j < len(ids) and ids[j] == sep_id:
                events.append(("open" if t == open_id else "close", tokenizer.decode(ids[i + 1 : j])))
                i = j + 1
            else:  # a tag that never ends (cut by max_new_tokens, or garbage): drop the marker and its tag text
                well_formed = False
                i = j
        elif t == sep_id:
            flush()
            well_formed = False
            i += 1
        else:
            run.append(t)
            i += 1
    flush()

    stack = ["message", "think" if thinking else "response"]
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    call: dict[str, Any] | None = None
    arg: tuple[str, str] | None = None
    buffer: list[str] = []
    closed_message = False
    for kind, value in events:
        if closed_message:
            well_formed = False
            break
        if kind == "text":
            top = stack[-1] if stack else None
            if top == "think":
                reasoning.append(value)
            elif top == "response":
                content.append(value)
            elif top in ("argument", "json"):
                buffer.append(value)
            elif value.strip():
                well_formed = False
            continue
        name = value.split(" ", 1)[0]
        if kind == "open":
            stack.append(name)
            attrs = {k: _unescape(v) for k, v in _ATTR.findall(value)}
            if name == "call":
                call = {"name": attrs.get("tool", ""), "arguments": {}, "raw": None}
            elif name == "argument":
                arg, buffer = (attrs.get("key", ""), attrs.get("type", "string")), []
            elif name == "json":
                buffer = []
            continue
        if name not in stack:
            well_formed = False
            continue
        while stack[-1] != name:  # close what was left open inside
            stack.pop()
            well_formed = False
        stack.pop()
        if name == "argument" and call is not None and arg is not None:
            text = "".join(buffer)
            if arg[1] == "string":
                call["arguments"][arg[0]] = text
            else:
                try:
                    call["arguments"][arg[0]] = json.loads(text)
                except json.JSONDecodeError:
                    call["arguments"][arg[0]] = text
            arg = None
        elif name == "json" and call is not None:
            call["raw"] = "".join(buffer)
        elif name == "call" and call is not None:
            arguments = call["raw"] if call["raw"] is not None else json.dumps(call["arguments"], ensure_ascii=False)
            calls.append(
                {"id": f"call_{len(calls)}", "type": "function",
                 "function": {"name": call["name"], "arguments": arguments}}
            )  # fmt: skip
            call = None
        elif name == "message":
            closed_message = True
    if not closed_message:
        well_formed = False
    return ParsedResponse(
        reasoning_content="".join(reasoning) if thinking else None,
        content="".join(content),
        tool_calls=calls or None,
        well_formed=well_formed,
    )


# ---- engines ---------------------------------------------------------------------------------------------------------
class Engine(Protocol):
    """Generates turns: ``submit`` queues one, ``poll`` blocks until at least one queued turn finished (returns
    ``[]`` when nothing is queued) and gives ``(job, TurnResult or the exception that failed it)``. ``capacity``:
    turns worth keeping in flight; ``describe()``: what identifies the model (recorded for resume checks)."""

    settings: RegenerateSettings
    capacity: int

    def describe(self) -> dict[str, Any]: ...

    def submit(self, job: TurnJob) -> None: ...

    def poll(self) -> list[tuple[TurnJob, TurnResult | BaseException]]: ...

    def close(self) -> None: ...


class LocalEngine:
    """The in-library K3 target with continuous batched decoding (``max_batch_size`` sequences per forward)."""

    def __init__(
        self,
        model,
        tokenizer,
        settings: RegenerateSettings,
        max_batch_size: int = 8,
        kda_recurrence: str = "auto",
        name: str = "local",
    ) -> None:
        from lightning_eagle.inference.batched import BatchedGenerator

        self.model, self.tokenizer, self.settings, self.name = model, tokenizer, settings, name
        stop = getattr(tokenizer, "end_of_msg_token_id", None)
        if stop is None:
            stop = getattr(model.config, "eos_token_id", None)
        if stop is None:
            raise ValueError("no end-of-message token: the tokenizer has no <|end_of_msg|> and the target no eos id")
        self.generator = BatchedGenerator(model, [stop], max_batch_size=max_batch_size, kda_recurrence=kda_recurrence)
        self.capacity = max_batch_size
        self._failed: list[tuple[TurnJob, BaseException]] = []

    def describe(self) -> dict[str, Any]:
        return {"backend": "local", "target": self.name, "tokenizer": getattr(self.tokenizer, "fingerprint", None)}

    def submit(self, job: TurnJob) -> None:
        from lightning_eagle.data.render_k3 import render_k3_chat
        from lightning_eagle.inference.batched import GenerationRequest

        s = self.settings
        try:
            ids = render_k3_chat(
                job.messages, self.tokenizer, tools=job.tools, add_generation_prompt=True, **s.render_options
            )
        except ChatFormatError as exc:
            self._failed.append((job, exc))
            return
        self.generator.submit(GenerationRequest(ids, s.max_new_tokens, s.temperature, s.top_p, job.seed, key=job))

    def poll(self) -> list[tuple[TurnJob, TurnResult | BaseException]]:
        out: list[tuple[TurnJob, TurnResult | BaseException]] = list(self._failed)
        self._failed.clear()
        while not out and len(self.generator):
            for result in self.generator.step():
                parsed = split_k3_response(result.tokens, self.tokenizer, self.settings.thinking)
                turn = TurnResult(
                    content=parsed.content,
                    reasoning_content=parsed.reasoning_content,
                    tool_calls=parsed.tool_calls,
                    finish_reason="stop" if result.stopped else "length",
                    completion_tokens=len(result.tokens),
                )
                out.append((result.key, turn))
        return out

    def close(self) -> None:
        pass


def load_local_engine(
    target: str,
    settings: RegenerateSettings,
    tokenizer: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_batch_size: int = 8,
    kda_recurrence: str = "auto",
) -> LocalEngine:
    """``target``: a K3 checkpoint folder or ``"quickstart"``; ``tokenizer`` defaults to ``"synthetic"`` for the
    quickstart target and to the target folder otherwise; ``device`` to CUDA when available; ``dtype`` to float32
    on CPU and bfloat16 on GPU."""
    import torch

    from lightning_eagle.data.tokenizer import resolve_tokenizer
    from lightning_eagle.k3.model import KimiK3ForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("float32" if torch.device(device).type == "cpu" else "bfloat16")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    tok = resolve_tokenizer(tokenizer or ("synthetic" if target == "quickstart" else target))
    model = KimiK3ForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype), device=device)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer {tok.name_or_path or tok.name!r} has {tok.vocab_size} ids but the target's vocabulary has "
            f"{model.config.vocab_size}: they do not belong together"
        )
    return LocalEngine(model, tok, settings, max_batch_size, kda_recurrence, name=str(target))


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


# ---- progress file ---------------------------------------------------------------------------------------------------
def progress_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".progress")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ProgressFile:
    """Append-only JSONL: a header, then ``{"row": i, "data": {...}}`` per finished row (``{"row": i, "error": …}``
    for a dropped one; dropped rows are retried by the next run). A torn last line is cut off on open."""

    def __init__(self, path: Path, header: dict[str, Any], fsync_interval: float = 2.0) -> None:
        self.path, self.header, self.fsync_interval = path, header, fsync_interval
        self.done: dict[int, dict[str, Any]] = {}
        self.torn = 0
        self._file = None
        self._last_sync = time.monotonic()

    def load(self) -> bool:
        """Read an existing file; True when it was resumed. Raises when it belongs to another input/settings."""
        if not self.path.exists():
            return False
        raw = self.path.read_bytes()
        end = raw.rfind(b"\n") + 1
        if end < len(raw):  # killed in the middle of a line: that row is simply generated again
            self.torn += 1
            with open(self.path, "r+b") as f:
                f.truncate(end)
        lines = raw[:end].decode("utf-8", "replace").splitlines()
        try:
            header = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("format") != PROGRESS_FORMAT:
            if len(lines) > 1:
                raise ValueError(f"{self.path}: not a regenerate progress file; delete it or pass --overwrite")
            self.path.unlink()  # a header torn at the very start: nothing was done
            return False
        mine, theirs = self.header, header
        if len(lines) == 1 and {k: theirs.get(k) for k in mine} != mine:
            self.path.unlink()  # a header and no row (e.g. a run that failed on a wrong --model): nothing to keep
            return False
        if {k: theirs.get(k) for k in mine} != mine:
            diff = sorted(k for k in mine if theirs.get(k) != mine[k])
            raise ValueError(
                f"{self.path} was written by a run with other {', '.join(diff)} (resuming would mix outputs): "
                "rerun with the same input and settings, or pass --overwrite to start over"
            )
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                self.torn += 1
                continue
            if isinstance(entry, dict) and isinstance(entry.get("row"), int) and isinstance(entry.get("data"), dict):
                self.done.setdefault(entry["row"], entry["data"])  # first wins: never two copies of a row
        return True

    def open(self) -> None:
        new = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if new:
            self._write(self.header, sync=True)

    def _write(self, entry: dict[str, Any], sync: bool = False) -> None:
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()  # in the OS after every row: a killed process loses nothing it reported done
        if sync or time.monotonic() - self._last_sync > self.fsync_interval:
            os.fsync(self._file.fileno())
            self._last_sync = time.monotonic()

    def add(self, row: int, data: dict[str, Any]) -> None:
        if row not in self.done:
            self.done[row] = data
            self._write({"row": row, "data": data})

    def add_error(self, row: int, error: str) -> None:
        self._write({"row": row, "error": error})

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


# ---- the driver ------------------------------------------------------------------------------------------------------
@dataclass
class RegenerateSummary:
    rows_total: int = 0  # chat rows read (malformed ones excluded)
    rows_resumed: int = 0  # already in the progress file
    rows_generated: int = 0  # finished by this run
    rows_unchanged: int = 0  # no assistant turn to regenerate (copied)
    rows_bad_skipped: int = 0
    rows_failed: int = 0  # dropped after a failed turn (--on-failed-row drop)
    turns_generated: int = 0
    turns_truncated: int = 0  # ended by max_new_tokens
    turns_kept: int = 0  # assistant turns with tool calls, kept verbatim
    completion_tokens: int = 0
    seconds: float = 0.0
    complete: bool = False  # the output file was written
    output: str = ""
    errors: list[str] = field(default_factory=list)

    def describe(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        text = (
            f"{self.rows_total} rows: {self.rows_resumed} resumed, {self.rows_generated} generated now "
            f"({self.rows_unchanged} without a turn to regenerate), {self.rows_bad_skipped} malformed skipped, "
            f"{self.rows_failed} failed and dropped; {self.turns_generated} turns generated "
            f"({self.turns_truncated} cut by max_new_tokens, {self.turns_kept} tool-call turns kept), "
            f"{self.completion_tokens} tokens in {self.seconds:.1f}s ({rate:.1f} tokens/s)"
        )
        text += f"\nwrote {self.output}" if self.complete else "\nstopped before the end: run again to resume"
        if self.errors:
            text += "\nerrors:\n  " + "\n  ".join(self.errors[:20])
        return text


@dataclass
class _RowWork:
    row: InputRow
    messages: list[dict[str, Any]]
    pending: deque[int]  # turns not submitted yet (context="generated": one at a time)
    outstanding: int = 0
    failed: str | None = None


def regenerate(
    input_path: str | Path,
    output_path: str | Path,
    engine: Engine,
    *,
    on_bad_row: str = "raise",
    on_failed_row: str = "raise",
    overwrite: bool = False,
    stop_after_rows: int | None = None,
    log: Callable[[str], None] | None = None,
    log_interval: float = 10.0,
) -> RegenerateSummary:
    """Regenerate every assistant turn of ``input_path`` with ``engine`` (and its settings); write ``output_path``
    (JSONL, input order).

    Resumes from ``output_path``'s progress file when one exists (same input and settings), refuses to replace an
    existing output unless ``overwrite``. ``on_failed_row``: ``"raise"`` stops at the first turn that fails after
    its retries (the progress is kept: run again to continue), ``"drop"`` leaves that row out and goes on.
    ``stop_after_rows``: finish at most this many rows in this call, then return without writing the output (a
    partial run; the next call resumes). The engine is closed on return.
    """
    if on_failed_row not in ("raise", "drop"):
        raise ValueError(f"on_failed_row must be 'raise' or 'drop', got {on_failed_row!r}")
    start = time.perf_counter()
    settings = engine.settings
    input_path, output_path = Path(input_path), Path(output_path)
    summary = RegenerateSummary(output=str(output_path))
    try:
        if output_path.suffix == ".json":
            raise ValueError(f"{output_path}: the output is JSONL (one row per line); name it .jsonl")
        if output_path.resolve() == input_path.resolve():
            raise ValueError(f"{output_path}: the output must not be the input file")
        rows, bad = read_input_rows(input_path, settings, on_bad_row)
        summary.rows_total, summary.rows_bad_skipped = len(rows), len(bad)
        summary.errors += bad
        header = {
            "format": PROGRESS_FORMAT,
            "input_sha256": _sha256(input_path),
            "settings": asdict(settings),
            "engine": engine.describe(),
        }
        progress = ProgressFile(progress_path(output_path), header)
        if overwrite:
            progress.path.unlink(missing_ok=True)
        elif output_path.exists() and not progress.path.exists():
            raise FileExistsError(f"{output_path} exists; pass --overwrite to regenerate it")
        progress.load()
        summary.rows_resumed = sum(1 for r in rows if r.index in progress.done)
        progress.open()
        try:
            finished = _Run(rows, engine, progress, summary, on_failed_row, stop_after_rows, log, log_interval)()
        finally:
            progress.close()
        if finished:
            with atomic_file(output_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                for r in rows:
                    if r.index in progress.done:
                        f.write(json.dumps(progress.done[r.index], ensure_ascii=False) + "\n")
            progress.path.unlink(missing_ok=True)
            summary.complete = True
    finally:
        engine.close()
    summary.seconds = time.perf_counter() - start
    return summary


class _Run:
    """The scheduling loop: rows start in input order while the engine has room; a row's turns run in sequence
    (``context="generated"``) or all at once (``"original"``); a finished row goes to the progress file."""

    def __init__(self, rows, engine, progress, summary, on_failed_row, stop_after_rows, log, log_interval) -> None:
        self.rows, self.engine, self.progress, self.summary = rows, engine, progress, summary
        self.settings: RegenerateSettings = engine.settings
        self.on_failed_row, self.stop_after_rows = on_failed_row, stop_after_rows
        self.log, self.log_interval = log, log_interval
        self.todo = deque(r for r in rows if r.index not in progress.done)
        self.work: dict[int, _RowWork] = {}
        self.in_flight = 0
        self.finished_now = 0
        self.start = time.perf_counter()

    def __call__(self) -> bool:
        """Run; True when every row was processed (False: stopped by ``stop_after_rows``)."""
        last_log = time.monotonic()
        while True:
            self._start_rows()
            if not self.work:
                return not self.todo
            results = self.engine.poll()
            if not results:
                raise RuntimeError(f"engine {self.engine.describe()} returned nothing with turns in flight")
            for job, result in results:
                self._on_result(job, result)
            if self.log is not None and time.monotonic() - last_log > self.log_interval:
                last_log = time.monotonic()
                self._log_progress()

    def _start_rows(self) -> None:
        limit = self.stop_after_rows
        while self.todo and self.in_flight < self.engine.capacity:
            if limit is not None and self.finished_now + len(self.work) >= limit:
                return
            r = self.todo.popleft()
            messages = [dict(m) for m in r.data["messages"]]
            w = _RowWork(r, messages, deque(turns_to_regenerate(messages)))
            self.summary.turns_kept += sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
            self.work[r.index] = w
            if not w.pending:
                self.summary.rows_unchanged += 1
                self._finish(w)
            elif self.settings.context == "generated":
                self._submit(w, w.pending.popleft())
            else:
                while w.pending:
                    self._submit(w, w.pending.popleft())

    def _submit(self, w: _RowWork, turn: int) -> None:
        source = w.messages if self.settings.context == "generated" else w.row.data["messages"]
        seed = self.settings.turn_seed(w.row.index, turn)
        self.engine.submit(TurnJob(w.row.index, turn, [dict(m) for m in source[:turn]], w.row.data.get("tools"), seed))
        w.outstanding += 1
        self.in_flight += 1

    def _on_result(self, job: TurnJob, result: TurnResult | BaseException) -> None:
        self.in_flight -= 1
        w = self.work[job.row]
        w.outstanding -= 1
        if isinstance(result, BaseException):
            message = f"{w.row.where}: messages[{job.turn}]: {result}"
            if self.on_failed_row == "raise":
                raise RegenerateError(
                    f"{message} (the rows done so far are kept in {self.progress.path}: run the same command again "
                    "to resume, or pass --on-failed-row drop to leave failing rows out)"
                ) from (result if isinstance(result, Exception) else None)
            w.failed = w.failed or message
            w.pending.clear()
        else:
            w.messages[job.turn] = result.message(w.row.data["messages"][job.turn], self.settings.thinking)
            self.summary.turns_generated += 1
            self.summary.turns_truncated += result.finish_reason == "length"
            self.summary.completion_tokens += result.completion_tokens
            if w.pending and w.failed is None:
                self._submit(w, w.pending.popleft())
        if w.outstanding == 0 and not w.pending:
            self._finish(w)

    def _finish(self, w: _RowWork) -> None:
        del self.work[w.row.index]
        self.finished_now += 1
        if w.failed is not None:
            self.summary.rows_failed += 1
            self.summary.errors.append(w.failed)
            self.progress.add_error(w.row.index, w.failed)
        else:
            self.progress.add(w.row.index, {**w.row.data, "messages": w.messages})
            self.summary.rows_generated += 1

    def _log_progress(self) -> None:
        done = len(self.progress.done) + self.summary.rows_failed
        rate = self.summary.completion_tokens / max(time.perf_counter() - self.start, 1e-9)
        self.log(f"regenerate: {done}/{len(self.rows)} rows, {self.summary.turns_generated} turns, {rate:.1f} tokens/s")


# ---- command line ----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-eagle regenerate",
        description="Replace every assistant turn of a chat file by the target's own response (resumable).",
    )
    parser.add_argument("input", help="chat file: JSONL (or a JSON list) of {'messages': [...]} rows")
    parser.add_argument("output", help="output JSONL (written atomically at the end; OUTPUT.progress meanwhile)")
    backend = parser.add_mutually_exclusive_group(required=True)
    backend.add_argument("--target", help="in-library target: a K3 checkpoint folder or 'quickstart'")
    backend.add_argument("--base-url", help="OpenAI-compatible API root, e.g. http://localhost:8000/v1")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", "--max-tokens", type=int, default=1024, help="per turn (default 1024)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", default="0", help="base seed of the per-turn seeds (default 0; 'none' = random)")
    gen.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                     help="K3 thinking on (default) or off; use the render options you train with")  # fmt: skip
    gen.add_argument("--thinking-effort", default="max", help="low|high|max|none (default max, the reference's)")
    gen.add_argument("--context", choices=CONTEXTS, default="generated",
                     help="earlier turns seen by a turn: the regenerated ones (default) or the input's")  # fmt: skip
    local = parser.add_argument_group("in-library target (--target)")
    local.add_argument("--tokenizer", default=None, help="default: synthetic for quickstart, else the target folder")
    local.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    local.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    local.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded per forward (default 8)")
    remote = parser.add_argument_group("endpoint (--base-url)")
    remote.add_argument("--model", default=None, help="served model name (default: the first of GET /models)")
    remote.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    remote.add_argument("--max-concurrency", type=int, default=16, help="requests in flight (default 16)")
    remote.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    remote.add_argument("--max-retries", type=int, default=6, help="retries per request (default 6)")
    remote.add_argument("--retry-backoff", type=float, default=1.0, help="first retry wait in s, doubled each time")
    remote.add_argument("--extra-body", default=None, help="JSON object merged into every request")
    run = parser.add_argument_group("run")
    run.add_argument("--on-bad-row", choices=["raise", "skip"], default="raise")
    run.add_argument("--on-failed-row", choices=["raise", "drop"], default="raise",
                     help="a turn failing after its retries stops the run (default) or drops its row")  # fmt: skip
    run.add_argument("--overwrite", action="store_true", help="replace OUTPUT and discard its progress")
    run.add_argument("--stop-after-rows", type=int, default=None, help="finish this many rows now, resume later")
    run.add_argument("--quiet", action="store_true")
    return parser


def main(argv: list[str]) -> None:
    """``lightning-eagle regenerate …`` (see :func:`build_parser`)."""
    args = build_parser().parse_args(argv)
    effort = None if str(args.thinking_effort).lower() in ("none", "null") else args.thinking_effort
    seed = None if str(args.seed).lower() in ("none", "null") else int(args.seed)
    settings = RegenerateSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=seed,
        thinking=args.thinking,
        thinking_effort=effort if args.thinking else None,
        context=args.context,
    )
    # Validate the input before loading a target or contacting a server.
    read_input_rows(args.input, settings, args.on_bad_row)
    if args.target is not None:
        engine: Engine = load_local_engine(
            args.target, settings, args.tokenizer, args.device, args.dtype, args.max_batch_size
        )
    else:
        extra = None
        if args.extra_body:
            try:
                extra = json.loads(args.extra_body)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--extra-body: not JSON ({exc.msg})") from None
            if not isinstance(extra, dict):
                raise ValueError("--extra-body: expected a JSON object")
        engine = EndpointEngine(
            args.base_url,
            settings,
            model=args.model,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
            max_concurrency=args.max_concurrency,
            timeout=args.timeout,
            max_retries=args.max_retries,
            retry_backoff=args.retry_backoff,
            extra_body=extra,
        )

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    summary = regenerate(
        args.input,
        args.output,
        engine,
        on_bad_row=args.on_bad_row,
        on_failed_row=args.on_failed_row,
        overwrite=args.overwrite,
        stop_after_rows=args.stop_after_rows,
        log=None if args.quiet else log,
    )
    print(summary.describe())
    if summary.rows_failed:  # asked for (--on-failed-row drop), but never only inside the summary
        first = f"; first: {summary.errors[0]}" if summary.errors else ""
        print(f"warning: {summary.rows_failed} row(s) failed and were left out of {args.output} (a later run "
              f"retries them){first}", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":  # python -m lightning_eagle.data.regenerate …
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
