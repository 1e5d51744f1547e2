"""Malformed input rows: every error names file, line, field and expected vs got; ``skip`` counts them."""

from __future__ import annotations

import json

import pytest

from lightning_eagle.data import DataRowError
from lightning_eagle.data.dataset import TokenizedChatDataset
from lightning_eagle.data.encoding import EncodeOptions
from lightning_eagle.data.loss_mask import KIMI_K3

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

BAD_ROWS = [
    pytest.param('{"messages": [', "<json>: invalid JSON: Expecting value at column 15", id="bad-json"),
    pytest.param(
        {"messages": [{"role": "bot", "content": "x"}]},
        "messages[0].role: expected one of ['system', 'user', 'assistant', 'tool'], got str \"bot\"",
        id="unknown-role",
    ),
    pytest.param(
        {"messages": [{"role": "user"}]},
        "messages[0].content: expected a string, got nothing (the field is missing)",
        id="missing-content",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content: expected a string, got null",
        id="null-content",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": 42}]},
        "messages[0].content: expected a string or a list of text parts, got int 42",
        id="non-string-text",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]},
        "messages[0].content[0].text: expected a string, got int 7",
        id="non-string-text-part",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        "messages[0].content[0].type: expected 'text' (text-only pipeline), got str \"image_url\"",
        id="image-part",
    ),
    pytest.param({"messages": []}, "messages: expected a non-empty list of messages, got an empty list", id="empty"),
    pytest.param({"messages": "hi"}, 'messages: expected a list of messages, got str "hi"', id="messages-not-list"),
    pytest.param(
        {"text": "hello"},
        "messages: expected a list of messages (or 'input_ids'), got a row with keys ['text']",
        id="no-messages",
    ),
    pytest.param([1, 2], "<row>: expected a JSON object with 'messages' (or 'input_ids'), got list [1, 2]", id="array"),
    pytest.param(
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": 1}]},
        "messages[1].reasoning_content: expected a string, got int 1",
        id="reasoning-type",
    ),
    pytest.param(
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]},
            ]
        },
        "messages[1].tool_calls[0].function.arguments: expected a JSON object, got a JSON list",
        id="tool-args-not-object",
    ),
    pytest.param(
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
        "messages[0].tool_calls[0].function.name: expected a non-empty string, got null",
        id="tool-call-no-name",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "result"}]},
        "messages[1]: tool result has no resolvable tool name (no matching tool_call_id)",
        id="orphan-tool-result",
    ),
    pytest.param(
        {"input_ids": [1, 600, 3]}, "input_ids[1]: expected an int in [0, 512), got int 600", id="token-out-of-range"
    ),
    pytest.param(
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1]},
        "loss_mask: expected 3 values (one per input id), got 2",
        id="mask-length",
    ),
    pytest.param(
        {"input_ids": [1, 2], "loss_mask": [0, 2]}, "loss_mask[1]: expected 0 or 1, got int 2", id="mask-value"
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "x"}], "input_ids": [1]},
        "<row>: expected either 'messages' or 'input_ids', got both",
        id="both-kinds",
    ),
]


def _build(files, k3_tok, on_bad_row="raise", **overrides):
    options = EncodeOptions(
        max_length=overrides.pop("max_length", 4096),
        render_options={"thinking": True, "thinking_effort": None},
        recovery_name=KIMI_K3.name,
        recovery_options=dict(KIMI_K3.defaults),
        on_bad_row=on_bad_row,
    )
    return TokenizedChatDataset.build(files, k3_tok, KIMI_K3, options, workers=0)


@pytest.mark.parametrize(("bad", "fragment"), BAD_ROWS)
def test_bad_row_raises_with_file_line_and_field(jsonl_writer, k3_tok, bad, fragment):
    path = jsonl_writer("rows.jsonl", [GOOD, "", bad, GOOD])  # blank line 2 is skipped, bad row is on line 3
    with pytest.raises(DataRowError) as info:
        _build([path], k3_tok)
    message = str(info.value)
    assert message.startswith(f"{path}:3: "), message
    assert fragment in message, message
    assert info.value.line == 3 and info.value.file == str(path)


@pytest.mark.parametrize(("bad", "fragment"), BAD_ROWS)
def test_bad_row_skipped_and_counted(jsonl_writer, k3_tok, bad, fragment):
    path = jsonl_writer("rows.jsonl", [GOOD, bad, GOOD])
    data = _build([path], k3_tok, on_bad_row="skip")
    assert len(data) == 2
    assert data.summary.rows_read == 3 and data.summary.rows_bad_skipped == 1 and data.summary.rows_kept == 2
    [example] = data.summary.bad_row_examples
    assert example.startswith(f"{path}:2: ") and fragment in example
    assert "1 malformed and skipped" in data.summary.describe()
    assert [data.source(i) for i in range(len(data))] == [(str(path), 1), (str(path), 3)]


def test_json_array_files_report_element_lines(tmp_path, k3_tok):
    path = tmp_path / "rows.json"
    path.write_text(
        "[\n" + json.dumps(GOOD) + ",\n\n" + json.dumps({"messages": [{"role": "user", "content": 1}]}) + "\n]\n"
    )
    with pytest.raises(DataRowError, match=r"rows.json:4: messages\[0\].content: expected a string"):
        _build([path], k3_tok)
    path.write_text("[\n" + json.dumps(GOOD) + ",\n  {oops}\n]")
    with pytest.raises(DataRowError, match=r"rows.json:3: <json>: invalid JSON: Expecting property name"):
        _build([path], k3_tok, on_bad_row="skip")  # a broken .json file cannot be split into rows: always raises
    path.write_text(json.dumps(GOOD))
    assert len(_build([path], k3_tok)) == 1  # a single object is one row
    path.write_text("[" + json.dumps(GOOD) + " " + json.dumps(GOOD) + "]")
    with pytest.raises(DataRowError, match="expected ',' or ']'"):
        _build([path], k3_tok)
    path.write_text("[" + json.dumps(GOOD))
    with pytest.raises(DataRowError, match="unterminated JSON array"):
        _build([path], k3_tok)


def test_non_utf8_file(tmp_path, k3_tok):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"messages": "\xff"}\n')
    with pytest.raises(DataRowError, match=r"rows.jsonl:1: <file>: not UTF-8 text"):
        _build([path], k3_tok)
