"""Bad inputs of ``cli.py acceptance`` (issue 39, "Nothing silent", part 3): guards on what it reads and writes.

Each case asserts one ``error:`` line naming the file or flag and the problem, no traceback, exit status 1, and
nothing written; every refusal comes before any model is loaded (the target's weights are never read, only its config;
the draft export's weights are never read), so the cases are quick.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from bad_input_helpers import GOOD, LIBRARY, fill, pattern, snapshot

from lightning_eagle.commands.cli import main
from lightning_eagle.data.prompt_sets import PromptSet, load_prompt_set
from lightning_eagle.inference.acceptance import MAX_EXTRAPOLATION, check_prompt_ids
from lightning_eagle.inference.decoding_settings import DecodingSettings
from lightning_eagle.inference.prompt_set_run import check_prompt_set_fits, parse_context_lengths
from lightning_eagle.k3 import loader as target_loader

GOOD_ROW = json.dumps({"prompt": "Sky?"}) + "\n"
DEEP_ROW = '{"turns": ' + "[" * 100_000 + "]" * 100_000 + "}"  # json.loads raises RecursionError on it
LONG_TEXT = "hello world " * 40_000  # renders to about 480K tokens: the bundled target declares 4096
BEYOND = "the longest context this target is measured at even extrapolated (16x its max_position_embeddings 4096)"


def _inputs(root: Path) -> None:
    """Every bad input of the table, written once per test under ``root``."""
    zipped = gzip.compress((GOOD_ROW * 64).encode())
    (root / "cut.jsonl.gz").write_bytes(zipped[: len(zipped) // 2])
    (root / "deep.jsonl").write_text(GOOD_ROW + DEEP_ROW + "\n")
    (root / "latin1.jsonl").write_bytes(GOOD_ROW.encode() + '{"prompt": "café"}\n'.encode("latin-1"))
    (root / "folder.jsonl").mkdir()
    (root / "long.jsonl").write_text(GOOD_ROW + json.dumps({"prompt": LONG_TEXT}) + "\n")
    (root / "long_turns.jsonl").write_text(json.dumps({"turns": ["Hi", LONG_TEXT]}) + "\n")
    long_chat = {"messages": [{"role": "user", "content": LONG_TEXT}, {"role": "assistant", "content": "ok"}]}
    (root / "long_chat.jsonl").write_text(json.dumps(long_chat) + "\n")
    (root / "good.jsonl").write_text(GOOD_ROW)
    chat = json.dumps(GOOD) + "\n"  # the chat report's --data: the training data's rows
    zipped = gzip.compress((chat * 64).encode())
    (root / "cut_chats.jsonl.gz").write_bytes(zipped[: len(zipped) // 2])
    (root / "deep_chats.jsonl").write_text(chat + '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    (root / "latin1_chats.jsonl").write_bytes(chat.encode() + '{"messages": "café"}\n'.encode("latin-1"))
    (root / "bom_chats.jsonl").write_bytes(b"\xef\xbb\xbf" + chat.encode())
    (root / "a_file").write_text("not a folder")
    (root / "out" / "acceptance.json").mkdir(parents=True)


CLI_CASES = [
    # ---- what it reads: prompt files through the training readers' guards
    pytest.param(
        ["--benchmarks", "$root/cut.jsonl.gz"],
        ["error: $root/cut.jsonl.gz:1: <file>: cannot read the compressed file (EOFError: Compressed file ended "
         "before the end-of-stream marker was reached)"],
        id="truncated-jsonl-gz",
    ),
    pytest.param(
        ["--benchmarks", "$root/deep.jsonl"],
        ["error: $root/deep.jsonl:2: a row nested deeper than Python's recursion limit (a pathological or corrupted "
         "row)"],
        id="row-nested-100000-deep",
    ),
    pytest.param(
        ["--benchmarks", "$root/latin1.jsonl"],
        ["error: $root/latin1.jsonl:2: <file>: not UTF-8 text (invalid continuation byte at byte "],
        id="undecodable-bytes",
    ),
    pytest.param(
        ["--benchmarks", "$root/folder.jsonl"],
        ["error: prompt set file '$root/folder.jsonl' is a folder, not a file: give the JSONL file itself"],
        id="folder-named-jsonl",
    ),
    pytest.param(
        ["--benchmarks", "$root/good.jsonl,$root/long.jsonl"],
        ["error: prompt set 'long', conversation 2 ($root/long.jsonl:2): its prompt renders to ", " tokens, beyond "
         f"65536 tokens, {BEYOND}; shorten it or leave it out"],
        id="480k-token-prompt-on-a-4k-target",
    ),
    pytest.param(
        ["--benchmarks", "$root/long_turns.jsonl", "--allow-extrapolation"],
        ["error: prompt set 'long_turns', conversation 1 ($root/long_turns.jsonl:1): its 2 user turns alone render "
         "to ", f" tokens, beyond 65536 tokens, {BEYOND}"],
        id="long-later-turn",
    ),
    pytest.param(
        ["--data", "$root/long_chat.jsonl"],
        ["error: --data $root/long_chat.jsonl: prompt 1 is ", f" tokens, beyond 65536 tokens, {BEYOND}; "
         "--max-prompt-tokens N skips longer prompts"],
        id="480k-token-chat-prompt",
    ),
    pytest.param(
        ["--data", "$root/cut_chats.jsonl.gz"],
        ["error: $root/cut_chats.jsonl.gz:1: <file>: cannot read the compressed file (EOFError: Compressed file "
         "ended before the end-of-stream marker was reached)"],
        id="data-truncated-jsonl-gz",
    ),
    pytest.param(
        ["--data", "$root/deep_chats.jsonl"],
        ["error: $root/deep_chats.jsonl:2: <json>: nested deeper than Python's recursion limit"],
        id="data-row-nested-100000-deep",
    ),
    pytest.param(
        ["--data", "$root/latin1_chats.jsonl"],
        ["error: $root/latin1_chats.jsonl:2: <file>: not UTF-8 text (invalid continuation byte at byte "],
        id="data-undecodable-bytes",
    ),
    pytest.param(
        ["--data", "$root/bom_chats.jsonl", "--max-prompt-tokens", "1"],
        ["error: --data $root/bom_chats.jsonl: no prompt of at most --max-prompt-tokens 1 (a conversation up to an "
         "assistant turn)"],
        id="data-with-a-bom-is-read-and-its-prompts-capped",
    ),
    # ---- context lengths: bounded, once each
    pytest.param(
        ["--context-lengths", "99999999999k", "--allow-extrapolation"],
        ["error: --context-lengths: '99999999999k' is 102399999998976 tokens, beyond 16384k (16777216), the longest "
         "context measured on any target (16x K3's declared max_position_embeddings, even with --allow-extrapolation)"],
        id="context-length-beyond-any-target",
    ),
    pytest.param(
        ["--context-lengths", "1k,128k", "--allow-extrapolation"],
        ["error: --context-lengths [131072] exceed 65536 tokens, the longest context this target is measured at even "
         "with --allow-extrapolation (16x its max_position_embeddings 4096)"],
        id="context-length-beyond-this-target-even-extrapolated",
    ),
    pytest.param(
        ["--context-lengths", "1k,8k"],
        ["error: --context-lengths [8192] exceed the target's max_position_embeddings 4096", "(up to 65536 tokens, 16x "
         "it, are measured with the flag); add --allow-extrapolation to measure them anyway"],
        id="context-length-beyond-declared",
    ),
    pytest.param(
        ["--context-lengths", "1k,1k"],
        ["error: --context-lengths names '1k' (1024 tokens) more than once: each length is measured once, one row of "
         "the table"],
        id="context-length-twice",
    ),
    pytest.param(
        ["--context-lengths", "1k,1024"],
        ["error: --context-lengths names '1024' (1024 tokens) more than once (as '1k')"],
        id="context-length-twice-spelled-differently",
    ),
    # ---- what it writes: checked before anything is loaded
    pytest.param(
        ["--benchmarks", "$root/good.jsonl", "--out", "$root/a_file/report"],
        ["error: the report folder (--out) $root/a_file/report cannot be created: $root/a_file exists and is not a "
         "folder"],
        id="out-under-a-file",
    ),
    pytest.param(
        ["--benchmarks", "$root/good.jsonl", "--out", "$root/a_file"],
        ["error: the report folder (--out) $root/a_file cannot be created: $root/a_file exists and is not a folder"],
        id="out-is-a-file",
    ),
    pytest.param(
        ["--benchmarks", "$root/good.jsonl", "--out", "$root/out"],
        ["error: the report folder (--out) $root/out: $root/out/acceptance.json is a folder, where the report writes "
         "the file acceptance.json"],
        id="out-holds-a-folder-named-like-its-file",
    ),
    pytest.param(
        ["--benchmarks", "$root/good.jsonl", "--out", "/sys/lightning-eagle-acceptance"],
        ["error: the report folder (--out) /sys/lightning-eagle-acceptance: cannot create it (/sys refuses new "
         "entries): "],
        id="out-unwritable",
    ),
    pytest.param(
        ["--json", "$root/out"],
        ["error: --json $root/out: a folder, not a file: give the file the report is written to"],
        id="json-is-a-folder",
    ),
    pytest.param(
        ["--json", "$root/a_file/report.json"],
        ["error: --json's folder $root/a_file cannot be created: $root/a_file exists and is not a folder"],
        id="json-under-a-file",
    ),
    pytest.param(
        ["--json", "/sys/lightning-eagle-acceptance.json"],
        ["error: --json's folder /sys: cannot write into: "],
        id="json-unwritable",
    ),
    pytest.param(
        ["--benchmarks", "$root/good.jsonl", "--json", "$root/report.json"],
        ["error: --json is the chat report's (without --benchmarks / --context-lengths; the per-set report writes "
         "acceptance.json under --out): it would be ignored here"],
        id="json-with-benchmarks-is-never-written",
    ),
    pytest.param(
        ["--out", "$root/report"],
        ["error: --out is the per-set report's (with --benchmarks or --context-lengths; the chat report writes its "
         "JSON to --json FILE): it would be ignored here"],
        id="out-without-benchmarks-is-never-written",
    ),
    # ---- sampling
    pytest.param(
        ["--temperature", "inf"], ["error: --temperature must be a finite number >= 0 (0 = greedy), got inf"],
        id="temperature-inf",
    ),
    pytest.param(
        ["--temperature", "nan"], ["error: --temperature must be a finite number >= 0 (0 = greedy), got nan"],
        id="temperature-nan",
    ),
    pytest.param(
        ["--top-p", "inf"], ["error: --top-p must be a finite number in (0, 1] (1 = no nucleus truncation), got inf"],
        id="top-p-inf",
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def draft_export(tmp_path_factory) -> Path:
    """A tiny real export: its config names its family (checked before any data is read); never loaded here."""
    from draft_helpers import tiny_draft

    from lightning_eagle.draft.export import export_draft

    return export_draft(tiny_draft(), tmp_path_factory.mktemp("draft") / "export")


@pytest.fixture(autouse=True)
def _no_model_is_loaded(monkeypatch, tmp_path_factory):
    """Every refusal comes before the target's weights (or the draft) are read; the tokenized-data cache is private."""
    monkeypatch.setattr(target_loader, "safe_open", lambda *a, **k: pytest.fail(f"target weights read: {a}"))
    monkeypatch.setenv("LIGHTNING_EAGLE_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("LIGHTNING_EAGLE_DEBUG", raising=False)


@pytest.mark.parametrize(("flags", "fragments"), CLI_CASES)
def test_acceptance_refuses_by_name_before_loading_anything(tmp_path, capsys, draft_export, flags, fragments):
    _inputs(tmp_path)
    if any(f.startswith("/sys/") for f in flags) and not Path("/sys").is_dir():
        pytest.skip("no /sys here: nothing at hand refuses new entries to every user")
    before = snapshot(tmp_path), snapshot(draft_export.parent)
    argv = ["acceptance", "--target", "quickstart", "--draft", str(draft_export), *fill(flags, root=tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    message = exit_info.value.code
    assert isinstance(message, str), message  # a str exit code: printed on stderr, exit status 1
    assert "\n" not in message and message.count("error:") == 1, message
    assert re.search(pattern(fill(fragments, root=tmp_path)), message), message
    assert "Traceback" not in capsys.readouterr().err
    # nothing written (the default report folder beside the draft included)
    assert (snapshot(tmp_path), snapshot(draft_export.parent)) == before


def test_a_refusal_is_one_error_line_and_exit_status_1_on_the_real_command_line(tmp_path):
    """The table's in-process exit code as the shell sees it: one ``error:`` line on stderr, no traceback, status 1."""
    done = subprocess.run(
        [sys.executable, str(LIBRARY.parent / "cli.py"), "acceptance", "--target", "quickstart", "--draft",
         str(tmp_path / "draft"), "--context-lengths", "1k,1k"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(LIBRARY.parent)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --context-lengths names '1k' (1024 tokens) more than once: each length is measured "
                      "once, one row of the table"], done.stderr[-3000:]  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_argparse_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["acceptance", "--target", "quickstart", "--draft", "x", "--temperature", "warm"])
    assert exit_info.value.code == 2
    assert "argument --temperature: invalid float value: 'warm'" in capsys.readouterr().err


def test_a_missing_draft_is_refused_before_the_chat_report_reads_its_data(tmp_path):
    """The bundled held-out chats are tokenized (and cached) when read: a missing draft is named first."""
    cache = Path(os.environ["LIGHTNING_EAGLE_CACHE"])
    with pytest.raises(SystemExit) as exit_info:
        main(["acceptance", "--target", "quickstart", "--draft", str(tmp_path / "nowhere")])
    assert exit_info.value.code == f"error: draft folder '{tmp_path / 'nowhere'}' does not exist"
    assert not any(cache.iterdir()) and not any(tmp_path.iterdir())


def test_a_set_measured_beyond_the_declared_length_says_so(tmp_path, capsys):
    """Prompts past max_position_embeddings (but within what the target holds) run, with a note on stderr."""
    mine = tmp_path / "mine.jsonl"
    mine.write_text(GOOD_ROW + json.dumps({"prompt": "hello world " * 450}) + "\n")  # about 5.4K tokens, 4096 declared
    with pytest.raises(SystemExit) as exit_info:  # stopped by the missing draft, after the note
        main(["acceptance", "--target", "quickstart", "--draft", str(tmp_path / "nowhere"), "--benchmarks", str(mine)])
    assert exit_info.value.code == f"error: draft folder '{tmp_path / 'nowhere'}' does not exist"
    assert re.search(r"note: prompt set 'mine' has prompts of up to \d+ tokens, beyond the target's "
                     r"max_position_embeddings 4096: measured there anyway", capsys.readouterr().err)  # fmt: skip


# ---- the readers themselves ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["", ".gz"])
def test_a_byte_order_mark_is_accepted_as_the_training_readers_accept_it(tmp_path, compression):
    path = tmp_path / f"bom.jsonl{compression}"
    raw = b"\xef\xbb\xbf" + (GOOD_ROW + json.dumps({"turns": ["a", "b"]}) + "\n").encode()
    path.write_bytes(gzip.compress(raw) if compression else raw)
    prompt_set = load_prompt_set(str(path))
    assert prompt_set.conversations == [["Sky?"], ["a", "b"]]
    assert prompt_set.source == str(path) and prompt_set.lines == (1, 2)


def test_a_json_array_set_and_the_lines_of_a_capped_set(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([{"prompt": "one"}, {"question": "two"}, {"turns": ["three"]}], indent=1))
    prompt_set = load_prompt_set(str(path), max_prompts=2)
    assert prompt_set.conversations == [["one"], ["two"]] and prompt_set.lines == (2, 5)


def test_a_missing_set_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=pattern([f"prompt set file '{tmp_path / 'nowhere.jsonl'}' does not exist"])):
        load_prompt_set(str(tmp_path / "nowhere.jsonl"))


def test_context_lengths_are_bounded_and_given_once():
    assert parse_context_lengths("1k,2k,16384k") == [1024, 2048, 16 * 1024 * 1024]
    with pytest.raises(ValueError, match=r"'16385k' is 16778240 tokens, beyond 16384k"):
        parse_context_lengths("16385k")
    with pytest.raises(ValueError, match=r"names '2k' \(2048 tokens\) more than once"):
        parse_context_lengths("2k,4k,2k")
    with pytest.raises(ValueError, match=r"'１k' is not a length above 512 tokens"):  # a full-width digit
        parse_context_lengths("１k")


def test_library_calls_refuse_prompts_past_what_the_target_holds():
    """What the command checks first is checked again where prompts are decoded (the callback, library calls)."""
    from lightning_eagle.data import synthetic_k3_tokenizer

    config = SimpleNamespace(max_position_embeddings=256, vocab_size=512)
    most = MAX_EXTRAPOLATION * 256
    with pytest.raises(ValueError, match=pattern([f"prompt 2 is {most + 1} tokens, beyond {most} tokens", "skip "
                                                  "longer prompts with max_prompt_tokens"])):  # fmt: skip
        check_prompt_ids([[1] * 10, [1] * (most + 1)], SimpleNamespace(config=config))
    check_prompt_ids([[1] * most], SimpleNamespace(config=config))  # the bound itself is measured
    prompt_set = PromptSet("mine", [["Hi"], ["word " * 5000]], "mine.jsonl", (1, 3))
    with pytest.raises(ValueError, match=pattern(["prompt set 'mine', conversation 2 (mine.jsonl:3): its prompt "
                                                  "renders to ", f"tokens, beyond {most} tokens"])):  # fmt: skip
        check_prompt_set_fits(prompt_set, synthetic_k3_tokenizer(), config)


def test_decoding_settings_refuse_a_non_finite_temperature_for_what_it_is():
    for value in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match=pattern([f"temperature must be a finite number >= 0 (0 = greedy), got "
                                                      f"{value!r}"])):  # fmt: skip
            DecodingSettings(temperature=value)
