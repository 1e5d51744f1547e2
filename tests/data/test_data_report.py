"""Data report (``lightning_eagle.data.report``): every number checked against the tokenized data, the command line
(``lightning_eagle.commands.data_report``) with the quickstart config, and the length plot."""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from pathlib import Path

import pytest

from lightning_eagle.commands.data_report import main, with_trainer_overrides
from lightning_eagle.data import ChatDataModule
from lightning_eagle.data.report import DataReport, _length_bins, data_report

REPO = Path(__file__).resolve().parents[2]
MAX_LENGTH = 512
ROBOT = "messages[0].role: expected one of ['system', 'user', 'assistant', 'tool'], got str \"robot\""
NO_CONTENT = "messages[1].content: expected a string, got nothing (the field is missing)"


def _qa(i: int) -> dict:
    answer = {"role": "assistant", "content": f"{2 * i}", "reasoning_content": f"{i}+{i}={2 * i}"}
    return {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}, answer]}


TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
# 1-based line -> row; strings are written as they are (line 2 is not JSON).
ROWS = [
    {"messages": [{"role": "system", "content": "You are K3."}, {"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]},
    '{"messages": [{"role": "user", "content": "hi"}',  # 2: invalid JSON -> refused
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                  {"role": "assistant", "content": "It is sunny."}]},
    {"messages": [{"role": "robot", "content": "beep"}]},  # 4: unknown role -> refused
    {"messages": [{"role": "user", "content": "Tell a long story."},
                  {"role": "assistant", "content": "once upon a time " * 60}]},  # 5: cut inside the answer, kept
    {"messages": [{"role": "user", "content": "read this: " + "blah " * 120},
                  {"role": "assistant", "content": "ok"}]},  # 6: cut before the answer -> dropped (no supervision)
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},  # 7: no content -> refused
    {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 0, 1, 1, 1, 1]},  # 8: pre-tokenized
    *[_qa(i) for i in range(12)],  # 9-20
]  # fmt: skip
KEPT_LINES = {1, 3, 5, 8, *range(9, 21)}


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _roles(lines) -> Counter:
    counts = Counter()
    for line in lines:
        row = ROWS[line - 1]
        if isinstance(row, dict):
            counts.update(m["role"] for m in row.get("messages", []))
    return counts


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("report_data") / "chats.jsonl", ROWS)


def _dm(chats: Path, cache: Path, **kwargs) -> ChatDataModule:
    options = {"train_files": [str(chats)], "max_length": MAX_LENGTH, "thinking_effort": None,
               "draft_vocab_size": 24, "cache_dir": str(cache)}  # fmt: skip
    return ChatDataModule(**{**options, **kwargs})


@pytest.fixture(scope="module")
def reported(chats, tmp_path_factory):
    """The report of a data module left at on_bad_row='raise', and a 'skip' data module set up as fit sets it up."""
    cache = tmp_path_factory.mktemp("report_cache")
    out = tmp_path_factory.mktemp("report_out")
    dm = _dm(chats, cache)  # on_bad_row="raise": fit would stop at line 2
    report = data_report(dm, out, vocab_sizes=[8, 12, 16, 32, 64])
    assert dm._train_data is None and dm.vocab_mapping is None  # the report leaves the data module alone
    reference = _dm(chats, cache, on_bad_row="skip")
    reference.setup("fit")
    return report, reference, out


def test_rows_refusals_truncation(reported, chats, tmp_path):
    report, reference, _ = reported
    src = report.source("train_files")
    assert src.files == [str(chats)] and report.source("val_files") is None
    assert (src.rows_read, src.rows_kept, src.rows_refused, src.rows_without_supervision) == (20, 16, 3, 1)
    assert src.refused_examples[0].startswith(f"{chats}:2: <json>: invalid JSON: ")
    assert src.refused_examples[1:] == [f"{chats}:4: {ROBOT}", f"{chats}:7: {NO_CONTENT}"]
    assert src.rows_kept == reference.summary["train"]["rows_kept"]
    assert {reference._train_data.source(i)[1] for i in range(len(reference._train_data))} == KEPT_LINES
    # Truncation: lines 5 and 6 are longer than max_length; checked against an uncut tokenization.
    assert src.rows_truncated == 2 and src.truncation_rate == 2 / 17
    uncut = _dm(chats, tmp_path, max_length=100_000, on_bad_row="skip", use_cache=False)
    uncut.setup()
    full = uncut._train_data
    assert {full.source(i)[1] for i in range(len(full)) if full.lengths()[i] > MAX_LENGTH} == {5, 6}
    assert src.row_formats == {"chat": 18, "unreadable": 1, "pretokenized": 1}
    assert (src.tokens, src.supervised_tokens) == (
        reference.summary["train"]["tokens"],
        reference.summary["train"]["supervised_tokens"],
    )


def test_splits_supervised_fraction_and_lengths(reported):
    report, reference, _ = reported
    for name, subset in (("train", reference.train_dataset), ("val", reference.val_dataset)):
        split = report.split(name)
        items = [subset[i] for i in range(len(subset))]
        tokens = sum(item["input_ids"].numel() for item in items)
        supervised = sum(int(item["loss_mask"].sum()) for item in items)
        assert (split.rows, split.tokens, split.supervised_tokens) == (len(items), tokens, supervised)
        assert split.supervised_fraction == supervised / tokens
        lengths = sorted(item["input_ids"].numel() for item in items)
        assert (split.length_min, split.length_max) == (lengths[0], lengths[-1])
        assert sum(b.rows[name] for b in report.length_bins) == len(items)
        # Supervised targets (x[q+1] with loss_mask[q] == 1) are what coverage divides by.
        assert split.supervised_targets == sum(int(item["loss_mask"][:-1].sum()) for item in items)
    assert (report.split("train").rows, report.split("val").rows) == (15, 1)
    # Only line 5 is kept at the cap (line 6 was cut too, then dropped).
    assert report.split("train").rows_at_max_length + report.split("val").rows_at_max_length == 1
    bins = report.length_bins
    assert bins[0].lo == 0 and bins[-1].hi == MAX_LENGTH
    assert all(a.hi + 1 == b.lo for a, b in zip(bins, bins[1:]))


def test_role_counts(reported):
    report, reference, _ = reported
    src = report.source("train_files")
    assert src.roles == {"system": 1, "user": 17, "assistant": 18, "tool": 1, "robot": 1}
    assert src.tool_calls == 1
    data = reference._train_data
    for name, subset in (("train", reference.train_dataset), ("val", reference.val_dataset)):
        lines = [data.source(i)[1] for i in subset.indices]
        assert report.split(name).roles == {k: v for k, v in _roles(lines).items() if v}, name
    kept = Counter(report.split("train").roles) + Counter(report.split("val").roles)
    assert kept == {"system": 1, "user": 15, "assistant": 16, "tool": 1}
    assert report.split("train").tool_calls + report.split("val").tool_calls == 1


def test_vocab_coverage(reported):
    report, reference, _ = reported
    sizes = [c.draft_vocab_size for c in report.coverage]
    assert sizes == [8, 12, 16, 24, 32, 64, 512]  # requested + configured (24) + the full vocabulary
    for column in ("train", "val"):
        values = [getattr(c, column) for c in report.coverage]
        assert all(0.0 <= v <= 1.0 for v in values)
        assert values == sorted(values) and values[-1] == 1.0
    configured = [c for c in report.coverage if c.configured]
    assert [c.draft_vocab_size for c in configured] == [24]
    # The same selection as the vocab map fit builds.
    assert configured[0].train == pytest.approx(reference.vocab_mapping.coverage, abs=1e-12)
    assert report.coverage[0].train < configured[0].train < 1.0


def test_files_text_and_png(reported, chats):
    report, _, out = reported
    text = (out / "report.txt").read_text()
    assert text == report.to_text() + "\n"
    for needle in ("refused rows (3):", f"{chats}:4: {ROBOT}", "supervised fraction", "truncated at max_length 512",
                   "Messages per role", "*           24", f"Plot: {out / 'lengths.png'}"):  # fmt: skip
        assert needle in text, needle
    loaded = json.loads((out / "report.json").read_text())
    assert loaded["format"] == "lightning_eagle.data_report/1"
    assert DataReport.from_dict(loaded) == report
    png = (out / "lengths.png").read_bytes()
    assert report.plot == str(out / "lengths.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR" and png[-8:-4] == b"IEND"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 400 and height > 200


def test_nothing_kept_still_reports(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [ROWS[1], ROWS[3], ROWS[6]])
    report = data_report(_dm(bad, tmp_path / "cache"), tmp_path / "out")
    src = report.source("train_files")
    assert (src.rows_read, src.rows_kept, src.rows_refused) == (3, 0, 3)
    assert report.split("train").rows == 0 and report.length_bins == []
    assert all(c.train is None for c in report.coverage)
    assert "no kept rows" in report.to_text() and (tmp_path / "out" / "lengths.png").is_file()


def test_tool_calls_with_arguments_that_are_not_json_are_counted_and_named(tmp_path):
    """Issue 30: such a call is rendered as a raw block and supervised without a word; the report now counts it."""
    broken = {**TOOL_CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"'}}
    row = json.loads(json.dumps(ROWS[2]))
    row["messages"][1]["tool_calls"] = [TOOL_CALL, broken]
    path = _write(tmp_path / "tools.jsonl", [ROWS[2], row, *[_qa(i) for i in range(4)]])
    report = data_report(_dm(path, tmp_path / "cache"), tmp_path / "out")
    src = report.source("train_files")
    assert src.rows_kept == 6 and src.tool_calls == 3  # kept and trained on, as before
    assert src.invalid_tool_arguments == 1
    assert src.invalid_tool_argument_examples == [f"{path}:2: tool_calls[1].function.arguments"]
    text = report.to_text()
    assert re.search(r"\(calls with non-JSON arguments\)\s+1\b", text), text
    assert (
        f"1 tool call(s) have arguments that are not a JSON object (e.g. {path}:2: tool_calls[1].function."
        "arguments): K3 renders them as a raw block and the draft is trained on them"
    ) in text


def test_val_files_are_their_own_split(chats, tmp_path):
    val = _write(tmp_path / "val.jsonl", [_qa(40), _qa(41), ROWS[3]])
    report = data_report(_dm(chats, tmp_path / "cache", val_files=[str(val)]))
    assert report.plot is None
    assert [s.name for s in report.sources] == ["train_files", "val_files"]
    assert report.source("val_files").rows_refused == 1 and report.source("val_files").roles["robot"] == 1
    assert (report.split("train").rows, report.split("val").rows) == (16, 2)
    assert report.split("val").roles == {"user": 2, "assistant": 2}


def test_length_bins_start_at_the_shortest_row_and_close_at_the_longest():
    bins = _length_bins({"train": [142, 200, 256], "val": [144]})
    assert [(b.lo, b.hi) for b in bins] == [(128 + 16 * k, 143 + 16 * k) for k in range(7)] + [(240, 256)]
    assert [b.rows for b in bins if any(b.rows.values())] == [
        {"train": 1, "val": 0}, {"train": 0, "val": 1}, {"train": 1, "val": 0}, {"train": 1, "val": 0}
    ]  # fmt: skip
    assert [(b.lo, b.hi, b.rows) for b in _length_bins({"train": [147, 147], "val": []})] == [
        (147, 147, {"train": 2, "val": 0})
    ]


def test_trainer_overrides_follow_the_config():
    words = ["--data.max_length", "64", "--config", "c.yaml", "--trainer.default_root_dir", "r"]
    out = with_trainer_overrides(words)
    assert out[:4] == words[:4] and out[-2:] == words[-2:] and "--trainer.accelerator" in out[4:-2]


def test_main_with_quickstart_config(chats, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    common = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--data.train_files", str(chats),
              "--data.max_length", str(MAX_LENGTH), "--data.cache_dir", str(tmp_path / "cache")]  # fmt: skip
    main([*common, "--out", str(tmp_path / "rep")])
    printed = capsys.readouterr().out
    text = (tmp_path / "rep" / "report.txt").read_text()
    assert text.strip() in printed
    loaded = DataReport.from_dict(json.loads((tmp_path / "rep" / "report.json").read_text()))
    assert loaded.settings["on_bad_row"] == "raise" and loaded.settings["draft_vocab_size"] == 320
    src = loaded.source("train_files")
    assert (src.rows_read, src.rows_kept, src.rows_refused, src.rows_truncated) == (20, 16, 3, 2)
    assert (tmp_path / "rep" / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    main(common)  # default: <trainer.default_root_dir>/data_report
    assert (tmp_path / "runs" / "quickstart" / "data_report" / "report.json").is_file()


def test_main_refuses_data_that_is_not_chats(monkeypatch):
    """A features config (HiddenStateDataModule) has no chats to report on: refused by name, nothing tokenized."""
    from types import SimpleNamespace

    from lightning_eagle.commands import config_cli

    class HiddenStateDataModule:
        pass

    seen = []

    def fake_make_cli(words, from_sys_argv, run=True):
        seen.append((words, from_sys_argv, run))
        return SimpleNamespace(datamodule=HiddenStateDataModule())

    monkeypatch.setattr(config_cli, "make_cli", fake_make_cli)
    with pytest.raises(ValueError, match=r"^data-report reads chats through ChatDataModule, the config's data is "
                                         r"HiddenStateDataModule$"):  # fmt: skip
        main(["--config=quickstart", "--out", "unused"])
    [(words, from_sys_argv, run)] = seen
    assert run is False and from_sys_argv is False
    assert words[0].startswith("--config=") and words[0].endswith("quickstart.yaml")  # the packaged name resolved
    assert words[1:3] == ["--trainer.accelerator", "cpu"] and "--out" not in words
