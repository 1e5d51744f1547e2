"""``regenerate``: assistant turns replaced by the target's own responses, from the in-library tiny target (batched
incremental decoding) or from a real local OpenAI-compatible HTTP server that decodes with our inference code.

Checked: batched decoding = plain decoding (greedy and seeded sampling, prompts of mixed lengths, continuous
refill); the K3 response splitter inverts the renderer; output rows are valid chats the data pipeline accepts, in
input order, assistant turns replaced by exactly what plain greedy decoding gives, other turns unchanged; the
endpoint path (with injected 500 / 429 / dropped connections) gives the same rows as the local path; resume after a
stop, a torn progress line, duplicates, and a ``kill -9`` of a CLI subprocess ends with every row exactly once, equal
to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from lightning_eagle.commands.regenerate import main
from lightning_eagle.data import render_k3_chat, synthetic_k3_tokenizer
from lightning_eagle.data.loss_mask import get_loss_mask_recovery
from lightning_eagle.data.regenerate import (
    EndpointEngine,
    RegenerateError,
    RegenerateSettings,
    TurnJob,
    progress_path,
    regenerate,
    split_k3_response,
    turns_to_regenerate,
)
from lightning_eagle.data.rows import DataRowError, validate_row
from lightning_eagle.data.synthetic_corpus import bundled_sample_path
from lightning_eagle.inference import plain_generate
from lightning_eagle.inference.batched import BatchedGenerator, GenerationRequest, sample_token
from lightning_eagle.inference.local_engine import LocalEngine
from lightning_eagle.inference.sampling import pick_token

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 40
# Thinking off keeps the tiny target's turns short (~15-35 tokens); one test runs with thinking on.
SETTINGS = RegenerateSettings(max_new_tokens=MAX_NEW, thinking=False, thinking_effort=None)


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one-token forwards in Python loops: threads only add contention on 2 shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    from lightning_eagle import KimiK3ForCausalLM

    return KimiK3ForCausalLM.from_pretrained("quickstart", dtype=torch.float32)


@pytest.fixture(scope="module")
def tok():
    return synthetic_k3_tokenizer()


def _chats() -> list[dict]:
    """Bundled rows (one system prompt, one two-turn row) plus a kept tool-call turn and a row with nothing to do."""
    bundled = [json.loads(line) for line in bundled_sample_path().read_text().splitlines()[:6]]
    tool_row = {
        "id": "tool",
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "user", "content": "What sound does a dog make?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "function": {"name": "lookup", "arguments": {"animal": "dog"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "woof"},
            {"role": "assistant", "content": "A dog says woof.", "name": "k3"},
            {"role": "user", "content": "Thanks!"},
        ],
    }  # fmt: skip
    no_turn = {"id": "none", "messages": [{"role": "user", "content": "Hello?"}]}
    return [*bundled[:3], tool_row, *bundled[3:], no_turn]


@pytest.fixture(scope="module")
def chats_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("regen") / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _chats()))
    return path


def _local(target, tok, settings=SETTINGS, max_batch_size=4) -> LocalEngine:
    return LocalEngine(target, tok, settings, max_batch_size=max_batch_size, name="quickstart")


def _prompt(tok, messages, tools=None, settings=SETTINGS) -> list[int]:
    return render_k3_chat(messages, tok, tools=tools, add_generation_prompt=True, **settings.render_options)


@pytest.fixture(scope="module")
def local_greedy(target, tok, chats_file, tmp_path_factory) -> list[dict]:
    """The uninterrupted local greedy run (the reference the other runs are compared with)."""
    out = tmp_path_factory.mktemp("local") / "out.jsonl"
    summary = regenerate(chats_file, out, _local(target, tok))
    assert summary.complete and not progress_path(out).exists()
    return _read(out)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- batched decoding ------------------------------------------------------------------------------------------------
def _mixed_prompts(tok) -> list[list[int]]:
    chats = [json.loads(line) for line in bundled_sample_path().read_text().splitlines()[:5]]
    prompts = []
    for i, chat in enumerate(chats):
        options = {"thinking": i % 3 != 0, "thinking_effort": "max" if i == 4 else None}  # 69..~500 tokens
        prompts.append(render_k3_chat(chat["messages"][:-1], tok, add_generation_prompt=True, **options))
    return prompts + [prompts[0][:9], prompts[1][:50]]  # short ones: below the chunked-prefill threshold


@pytest.mark.slow
def test_batched_decoding_equals_plain_decoding(target, tok):
    prompts = _mixed_prompts(tok)
    assert max(map(len, prompts)) > 4 * 16 > min(map(len, prompts))  # padded prefills take the chunked KDA path
    stop, n_new = [tok.end_of_msg_token_id], 32
    greedy = [plain_generate(target, p, n_new, stop_token_ids=stop) for p in prompts]
    sampled = [plain_generate(target, p, n_new, 1.0, seed=i, stop_token_ids=stop) for i, p in enumerate(prompts[:3])]
    # 10 requests through 3 slots: rows finish at different steps and queued prompts join the running batch.
    gen = BatchedGenerator(target, stop, max_batch_size=3)
    requests = [GenerationRequest(p, n_new) for p in prompts]
    requests += [GenerationRequest(p, n_new, temperature=1.0, seed=i) for i, p in enumerate(prompts[:3])]
    results = gen.generate(requests)
    n = len(prompts)
    assert [r.tokens for r in results[:n]] == [g.tokens for g in greedy]
    assert [r.tokens for r in results[n:]] == [s.tokens for s in sampled]
    assert [r.stopped for r in results[:n]] == [g.stopped for g in greedy]
    assert any(g.stopped for g in greedy) and not all(g.stopped for g in greedy)
    assert gen.forwards < sum(len(r.tokens) for r in results) / 2  # several sequences per forward


def test_sample_token_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    gen = torch.Generator().manual_seed(0)
    assert {sample_token(logits, 1.0, 0.3, gen) for _ in range(20)} == {0}  # nucleus = the top token
    assert {sample_token(logits, 1.0, 0.8, gen) for _ in range(200)} == {0, 1}  # p = 0.61, 0.22: top two
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [sample_token(logits, 0.7, 1.0, a) for _ in range(10)] == [pick_token(logits, 0.7, b) for _ in range(10)]
    assert sample_token(logits, 0.0, 0.1, None) == 0


# ---- the response splitter -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("thinking", [True, False])
def test_split_inverts_the_renderer(tok, thinking):
    before = [{"role": "user", "content": "hi <|close|>response<|sep|> there"}]
    reply = {
        "role": "assistant",
        "content": "Use <|open|>tools<|sep|> literally.",
        "reasoning_content": "Think about <|end_of_msg|> first.",
        "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "f", "arguments": json.dumps({"a": "x", "n": 3, "o": {"k": [1]}})}},
        ],
    }  # fmt: skip
    options = {"thinking": thinking, "thinking_effort": None}
    prompt = render_k3_chat(before, tok, add_generation_prompt=True, **options)
    full = render_k3_chat([*before, reply], tok, **options)
    assert full[: len(prompt)] == prompt
    parsed = split_k3_response(full[len(prompt) :], tok, thinking)
    assert parsed.well_formed
    assert parsed.content == reply["content"]
    assert parsed.reasoning_content == (reply["reasoning_content"] if thinking else None)
    assert parsed.tool_calls == reply["tool_calls"]
    # Cut anywhere (max_new_tokens): no exception, a prefix of the content, not well formed.
    generated = full[len(prompt) :]
    for cut in range(0, len(generated) - 1, 7):
        part = split_k3_response(generated[:cut], tok, thinking)
        assert reply["content"].startswith(part.content) and not part.well_formed


# ---- the in-library target -------------------------------------------------------------------------------------------
def test_regenerate_local_greedy(target, tok, chats_file, local_greedy):
    chats = _chats()
    assert [row["id"] for row in local_greedy] == [row["id"] for row in chats]  # every row, in input order
    recovery = get_loss_mask_recovery(tok)
    changed = 0
    for original, row in zip(chats, local_greedy):
        assert validate_row(row, tok.vocab_size) == "chat"
        assert {k: v for k, v in row.items() if k != "messages"} == {
            k: v for k, v in original.items() if k != "messages"
        }
        turns = turns_to_regenerate(original["messages"])
        assert len(row["messages"]) == len(original["messages"])
        for i, (old, new) in enumerate(zip(original["messages"], row["messages"])):
            if i not in turns:
                assert new == old  # users, system, tool results, tool-call turns: unchanged
                continue
            assert set(new) <= {"role", "content", "name"} and new.get("name") == old.get("name")
            changed += new != old
            # The turn is exactly plain greedy decoding of the rendered context (the regenerated turns before it).
            prompt = _prompt(tok, row["messages"][:i], row.get("tools"))
            plain = plain_generate(target, prompt, MAX_NEW, stop_token_ids=[tok.end_of_msg_token_id])
            parsed = split_k3_response(plain.tokens, tok, thinking=False)
            assert (new["content"], new.get("tool_calls")) == (parsed.content, parsed.tool_calls)
            if plain.stopped and parsed.well_formed:  # the rendered row holds exactly the target's tokens
                rendered = render_k3_chat(row["messages"][: i + 1], tok, tools=row.get("tools"), thinking=False,
                                          thinking_effort=None)  # fmt: skip
                assert rendered == prompt + plain.tokens
        # The training pipeline accepts the row and supervises the regenerated turns.
        ids = render_k3_chat(row["messages"], tok, tools=row.get("tools"), thinking=False, thinking_effort=None)
        assert int(recovery.compute(tok, ids).sum()) > 0 or not turns
    assert changed >= 3


def test_regenerate_local_deterministic_and_resumable(target, tok, chats_file, local_greedy, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    first = regenerate(chats_file, out, _local(target, tok, max_batch_size=1), stop_after_rows=3)
    assert not first.complete and not out.exists() and first.rows_generated == 3
    # The rest through the command line (it loads the quickstart target itself), 8 sequences per forward.
    argv = [str(chats_file), str(out), "--target", "quickstart", "--max-new-tokens", str(MAX_NEW), "--no-thinking",
            "--thinking-effort", "none", "--max-batch-size", "8", "--quiet"]  # fmt: skip
    main(argv)
    assert f"3 resumed, {len(_chats()) - 3} generated now" in capsys.readouterr().out
    assert _read(out) == local_greedy  # batch 1 then 8, resumed = batch 4 uninterrupted
    assert not progress_path(out).exists()
    with pytest.raises(FileExistsError, match="--overwrite"):
        regenerate(chats_file, out, _local(target, tok))


def test_regenerate_thinking_and_sampling(target, tok, chats_file, tmp_path):
    settings = RegenerateSettings(max_new_tokens=48, temperature=0.9, top_p=0.9, seed=7, thinking=True,
                                  thinking_effort=None, context="original")  # fmt: skip
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in _chats()[:4]))
    a = regenerate(small, tmp_path / "a.jsonl", _local(target, tok, settings, max_batch_size=4))
    regenerate(small, tmp_path / "b.jsonl", _local(target, tok, settings, max_batch_size=2))
    rows_a, rows_b = _read(tmp_path / "a.jsonl"), _read(tmp_path / "b.jsonl")
    assert rows_a == rows_b  # per-turn seeds: independent of batching
    assert a.turns_generated == 4 and a.turns_kept == 1
    replies = [m for row in rows_a for i, m in enumerate(row["messages"]) if i in turns_to_regenerate(row["messages"])]
    assert all("reasoning_content" in m for m in replies) and any(m["reasoning_content"] for m in replies)
    other = RegenerateSettings(**{**settings.__dict__, "seed": 8})
    regenerate(small, tmp_path / "c.jsonl", _local(target, tok, other))
    assert _read(tmp_path / "c.jsonl") != rows_a


def test_regenerate_bad_rows(target, tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    good = _chats()[0]
    path.write_text(json.dumps(good) + "\n{not json\n" + json.dumps({"messages": [{"role": "bot"}]}) + "\n")
    with pytest.raises(DataRowError, match=r"bad\.jsonl:2: <json>"):
        regenerate(path, tmp_path / "out.jsonl", _local(target, tok))
    summary = regenerate(path, tmp_path / "out.jsonl", _local(target, tok), on_bad_row="skip")
    assert summary.rows_bad_skipped == 2 and len(_read(tmp_path / "out.jsonl")) == 1
    assert any("bad.jsonl:3: messages[0].role" in e for e in summary.errors)


# ---- a real OpenAI-compatible server ---------------------------------------------------------------------------------
class _K3Server(ThreadingHTTPServer):
    """Chat completions from the tiny target: render with the K3 template + generation prompt, decode with
    ``plain_generate``, split like a reasoning parser. ``faults`` maps a last-user-message substring to what its
    *first* request gets (500, 429, "drop" = connection closed without a response) or 400 (every request)."""

    daemon_threads = True

    def __init__(self, model, tokenizer) -> None:
        super().__init__(("127.0.0.1", 0), _K3Handler)
        self.model, self.tokenizer = model, tokenizer
        self.lock = threading.Lock()
        self.faults: dict[str, object] = {}
        self.seen: set[str] = set()
        self.log: list[tuple[str, object]] = []
        self.delay = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def fault_for(self, messages) -> object:
        last = next((m.get("content") for m in reversed(messages) if m["role"] == "user"), "")
        key = json.dumps(messages, sort_keys=True)
        with self.lock:
            for needle, fault in self.faults.items():
                if needle in str(last) and (fault == 400 or key not in self.seen):
                    self.seen.add(key)
                    self.log.append((needle, fault))
                    return fault
            self.seen.add(key)
        return None


class _K3Handler(BaseHTTPRequestHandler):
    server: _K3Server

    def log_message(self, *args) -> None:
        pass

    def _json(self, code: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": "k3-tiny", "object": "model"}]})
        self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        if self.path != "/v1/chat/completions":
            return self._json(404, {"error": {"message": "not found"}})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        fault = server.fault_for(body["messages"])
        if fault == "drop":
            self.close_connection = True  # no status line at all: the client sees a dropped connection
            return
        if fault in (500, 429, 400):
            headers = {"Retry-After": "0"} if fault == 429 else None
            return self._json(fault, {"error": {"message": f"injected {fault}"}}, headers)
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("thinking", True)
        ids = render_k3_chat(body["messages"], server.tokenizer, tools=body.get("tools"), add_generation_prompt=True,
                             thinking=thinking, thinking_effort=kwargs.get("thinking_effort", "max"))  # fmt: skip
        time.sleep(server.delay)
        stop = [server.tokenizer.end_of_msg_token_id]
        temperature, top_p = float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0))
        with server.lock:
            if top_p < 1.0:
                gen = BatchedGenerator(server.model, stop, max_batch_size=1)
                request = GenerationRequest(ids, body["max_tokens"], temperature, top_p, body.get("seed"))
                result = gen.generate([request])[0]
                tokens, stopped = result.tokens, result.stopped
            else:
                out = plain_generate(server.model, ids, body["max_tokens"], temperature, body.get("seed"),
                                     stop_token_ids=stop)  # fmt: skip
                tokens, stopped = out.tokens, out.stopped
        parsed = split_k3_response(tokens, server.tokenizer, thinking)
        message = {"role": "assistant", "content": parsed.content}
        if thinking:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        self._json(200, {
            "id": "chatcmpl-test", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop" if stopped else "length"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                      "total_tokens": len(ids) + len(tokens)},
        })  # fmt: skip


@pytest.fixture(scope="module")
def server(target, tok):
    srv = _K3Server(target, tok)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def fresh_server(server):
    server.faults, server.seen, server.log, server.delay = {}, set(), [], 0.0
    return server


def _endpoint(server, settings=SETTINGS, **kwargs) -> EndpointEngine:
    kwargs = {"max_concurrency": 3, "retry_backoff": 0.01, "timeout": 60.0, **kwargs}
    return EndpointEngine(server.base_url, settings, **kwargs)


def test_regenerate_endpoint_equals_local_with_retries(fresh_server, chats_file, local_greedy, tmp_path):
    fresh_server.faults = {"Spell cat": 500, "Count from": 429, "color is the sky": "drop", "19 times": 500}
    engine = _endpoint(fresh_server)
    assert engine.model == "k3-tiny"  # from GET /models
    out = tmp_path / "out.jsonl"
    summary = regenerate(chats_file, out, engine)
    assert summary.complete and engine.retries == 4
    assert sorted(str(f) for _, f in fresh_server.log) == ["429", "500", "500", "drop"]
    assert _read(out) == local_greedy  # server (plain decoding) = in-library batched decoding


def test_regenerate_endpoint_sampled_equals_local(target, tok, fresh_server, tmp_path):
    settings = RegenerateSettings(max_new_tokens=48, temperature=0.8, top_p=0.95, seed=3, thinking=True,
                                  thinking_effort=None)  # fmt: skip
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in _chats()[:3]))
    regenerate(small, tmp_path / "local.jsonl", _local(target, tok, settings))
    regenerate(small, tmp_path / "remote.jsonl", _endpoint(fresh_server, settings))
    rows = _read(tmp_path / "remote.jsonl")
    assert rows == _read(tmp_path / "local.jsonl")  # reasoning_content from the server's message = local split
    assert all(isinstance(row["messages"][1].get("reasoning_content"), str) for row in rows)


def test_regenerate_endpoint_resume(fresh_server, chats_file, local_greedy, tmp_path):
    out = tmp_path / "out.jsonl"
    progress = progress_path(out)
    s1 = regenerate(chats_file, out, _endpoint(fresh_server), stop_after_rows=2)
    assert not s1.complete and not out.exists()
    lines = progress.read_text().splitlines()
    assert json.loads(lines[0])["format"] and sorted(json.loads(x)["row"] for x in lines[1:]) == [0, 1]
    # A duplicated row and a torn last line (killed mid-write) must neither duplicate nor lose a row.
    with open(progress, "a") as f:
        f.write(lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    s2 = regenerate(chats_file, out, _endpoint(fresh_server, max_concurrency=1), stop_after_rows=3)
    assert s2.rows_resumed == 2 and s2.rows_generated == 3 and not s2.complete
    # Other settings must not resume these rows.
    other = RegenerateSettings(**{**SETTINGS.__dict__, "max_new_tokens": MAX_NEW + 1})
    with pytest.raises(ValueError, match="max_new_tokens|settings"):
        regenerate(chats_file, out, _endpoint(fresh_server, other))
    s3 = regenerate(chats_file, out, _endpoint(fresh_server))
    assert s3.complete and s3.rows_resumed == 5 and not progress.exists()
    assert _read(out) == local_greedy


def test_regenerate_endpoint_failures(fresh_server, chats_file, tmp_path, capsys):
    fresh_server.faults = {"What sound does a cat": 400}
    out = tmp_path / "out.jsonl"
    with pytest.raises(RegenerateError, match=r"chats\.jsonl:\d+: messages\[1\]: .*HTTP 400"):
        regenerate(chats_file, out, _endpoint(fresh_server, max_concurrency=2))
    assert not out.exists() and progress_path(out).exists()  # the rows done so far are kept
    summary = regenerate(chats_file, out, _endpoint(fresh_server), on_failed_row="drop")
    assert summary.complete and summary.rows_failed == 1
    assert len(_read(out)) == len(_chats()) - 1
    # the command line says so on stderr, not only inside its summary
    cli_out = tmp_path / "cli.jsonl"
    main([str(chats_file), str(cli_out), "--base-url", fresh_server.base_url, "--max-new-tokens", str(MAX_NEW),
          "--no-thinking", "--thinking-effort", "none", "--on-failed-row", "drop", "--quiet"])  # fmt: skip
    assert f"warning: 1 row(s) failed and were left out of {cli_out} (a later run retries them); first: " in (
        capsys.readouterr().err
    )
    # A server that is not there: a clear error at the first request, not a hang (never reached: no retries).
    fresh_server.faults = {}
    dead = EndpointEngine("http://127.0.0.1:9/v1", SETTINGS, model="m", max_retries=1, retry_backoff=0.01, timeout=5)
    with pytest.raises(RegenerateError, match="connection refused: nothing is listening there"):
        regenerate(chats_file, tmp_path / "dead.jsonl", dead)


@pytest.mark.slow
def test_regenerate_cli_kill9_resume(fresh_server, chats_file, local_greedy, tmp_path):
    """``python -m lightning_eagle.commands.regenerate`` killed with SIGKILL mid-run, restarted: every row once, in
    order, equal to the uninterrupted run; the output is accepted by ChatDataModule."""
    fresh_server.delay = 0.3
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "lightning_eagle.commands.regenerate", str(chats_file), str(out),
           "--base-url", fresh_server.base_url, "--max-new-tokens", str(MAX_NEW), "--no-thinking",
           "--thinking-effort", "none", "--max-concurrency", "1", "--retry-backoff", "0.01", "--quiet"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    progress = progress_path(out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.exists() and len(progress.read_text().splitlines()) >= 3:  # header + 2 rows
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[0].decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(progress.read_text().splitlines()) - 1
    assert 2 <= done_before < len(_chats()) and not out.exists()
    fresh_server.delay = 0.0
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"{done_before} resumed" in result.stdout
    assert _read(out) == local_greedy and not progress.exists()

    from lightning_eagle.data.datamodule import ChatDataModule

    dm = ChatDataModule(train_files=[str(out)], tokenizer="synthetic", thinking=False, thinking_effort=None,
                        val_fraction=0.0, use_cache=False, max_length=1024)  # fmt: skip
    dm.setup("fit")
    assert len(dm.train_dataset) == len(_chats()) - 1  # the row without an assistant turn has nothing supervised


def test_nothing_listening_fails_at_once_with_the_reason(capsys):
    """Before: a refused connection was retried with full backoff for 72 s, printing nothing."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(RegenerateError, match=r"GET http://127.0.0.1:\d+/v1/models: connection refused: nothing is "
                                              r"listening there; is the server running"):  # fmt: skip
        EndpointEngine(f"http://127.0.0.1:{port}/v1", SETTINGS)
    assert time.monotonic() - start < 5


def test_thinking_without_a_server_reasoning_parser_is_refused_not_written_empty():
    """Before: a server with no reasoning parser gave no reasoning_content and the row got "" (an empty thought)."""
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "<think>hm</think>Hi"},
                          "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}  # fmt: skip

    class NoParser(BaseHTTPRequestHandler):
        def do_GET(self):
            self._send({"data": [{"id": "m"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(reply)

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NoParser)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        thinking = RegenerateSettings(max_new_tokens=8, thinking=True, thinking_effort=None)
        engine = EndpointEngine(f"http://127.0.0.1:{server.server_port}/v1", thinking)
        job = TurnJob(row=0, turn=1, messages=[{"role": "user", "content": "Hi"}], tools=None, seed=None)
        with pytest.raises(RegenerateError, match="thinking is on but the server's answer has no reasoning_content"):
            engine._complete(job)
        no_thinking = EndpointEngine(f"http://127.0.0.1:{server.server_port}/v1", SETTINGS)
        assert no_thinking._complete(job).reasoning_content is None
    finally:
        server.shutdown()


def test_a_progress_file_without_a_finished_row_does_not_block_the_corrected_rerun(tmp_path):
    """Before: a run that failed before its first row (a wrong --model) left a header (and error lines) that refused
    the fixed rerun."""
    from lightning_eagle.data.regenerate import PROGRESS_FORMAT, ProgressFile

    path = tmp_path / "out.jsonl.progress"
    path.write_text(json.dumps({"format": PROGRESS_FORMAT, "model": "wrong"}) + "\n")
    assert ProgressFile(path, {"format": PROGRESS_FORMAT, "model": "right"}).load() is False
    assert not path.exists()
    # a run whose every request failed (a wrong --model against a real server) logged only errors: nothing to keep
    errors = [json.dumps({"row": i, "error": "404 model 'wrong' not found"}) for i in range(3)]
    path.write_text("\n".join([json.dumps({"format": PROGRESS_FORMAT, "model": "wrong"}), *errors]) + "\n")
    assert ProgressFile(path, {"format": PROGRESS_FORMAT, "model": "right"}).load() is False
    assert not path.exists()
    # with a finished row the mismatch is still refused: resuming would mix outputs
    finished = json.dumps({"row": 0, "data": {"messages": []}})
    path.write_text("\n".join([json.dumps({"format": PROGRESS_FORMAT, "model": "wrong"}), *errors, finished]) + "\n")
    with pytest.raises(ValueError, match="was written by a run with other model"):
        ProgressFile(path, {"format": PROGRESS_FORMAT, "model": "right"}).load()
