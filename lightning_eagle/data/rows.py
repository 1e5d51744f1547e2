"""Chat rows and their validation, with errors that name file, line and field.

A (normalized) row is either a conversation ``{"messages": [...], "tools": [...]?}`` (OpenAI-style messages with
roles ``system``/``user``/``assistant``/``tool``) or a pre-tokenized row ``{"input_ids": [...], "loss_mask": [...]?}``.
Files in other formats (ShareGPT, Parquet, compressed JSONL, globs, directories) are read and normalized to these
by :mod:`lightning_eagle.data.formats`; :func:`lightning_eagle.data.formats.iter_rows` is the entry point.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lightning_eagle.data.render_k3 import KNOWN_ROLES, ChatFormatError, normalize_arguments


class DataRowError(ValueError):
    """A malformed input row: ``{file}:{line}: {field}: {problem}``."""

    SKIP_HINT = "to skip and count malformed rows instead, set on_bad_row='skip' (CLI: --data.on_bad_row skip)"

    def __init__(self, file: str, line: int, field: str, problem: str, hint: str = "") -> None:
        self.file, self.line, self.field, self.problem = file, line, field, problem
        super().__init__(f"{file}:{line}: {field}: {problem}" + (f" ({hint})" if hint else ""))


class RowProblem(ValueError):
    """A validation failure before the file/line context is attached."""

    def __init__(self, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class RawRow:
    """One parsed row and where it came from (``line`` is 1-based: the line of a JSON/JSONL file, the row of a Parquet
    file). ``fields``: for a row normalized from another format, the source field of each message
    (``conversations[3]``), so errors name what is in the file."""

    file: str
    line: int
    data: Any
    fields: tuple[str, ...] | None = None


@dataclass(frozen=True)
class RawLine:
    """One JSONL line not parsed yet (``text``): parsing is left to the tokenizer workers."""

    file: str
    line: int
    text: str


def describe_value(value: Any) -> str:
    """``type json`` of a value, cut to 40 characters, for "expected X, got Y" messages."""
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _expect(cond: bool, field: str, expected: str, value: Any) -> None:
    if not cond:
        raise RowProblem(field, f"expected {expected}, got {describe_value(value)}")


def iter_json_text(name: str, text: str) -> Iterator[RawRow]:
    """Rows of a ``.json`` file's text: the elements of a top-level array (each with the line it starts on), or the one
    top-level object."""
    decoder = json.JSONDecoder()
    idx, line, counted = 0, 1, 0

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    def skip_ws(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    def fail(pos: int, problem: str) -> DataRowError:
        return DataRowError(name, line_at(pos), "<json>", problem)

    idx = skip_ws(idx)
    if idx < len(text) and text[idx] != "[":
        try:
            value, end = decoder.raw_decode(text, idx)
        except json.JSONDecodeError as exc:
            raise DataRowError(name, exc.lineno, "<json>", f"invalid JSON: {exc.msg} at column {exc.colno}") from None
        if skip_ws(end) != len(text):
            raise fail(skip_ws(end), "extra data after the JSON value (use .jsonl for one object per line)")
        yield RawRow(name, line_at(idx), value)
        return
    if idx >= len(text):
        raise fail(idx, "empty file: expected a JSON array of conversations")
    idx = skip_ws(idx + 1)
    while idx < len(text) and text[idx] != "]":
        try:
            value, end = decoder.raw_decode(text, idx)
        except json.JSONDecodeError as exc:
            raise DataRowError(name, exc.lineno, "<json>", f"invalid JSON: {exc.msg} at column {exc.colno}") from None
        yield RawRow(name, line_at(idx), value)
        idx = skip_ws(end)
        if idx >= len(text):
            break
        if text[idx] == ",":
            idx = skip_ws(idx + 1)
        elif text[idx] != "]":
            raise fail(idx, "expected ',' or ']' between array elements")
    if idx >= len(text):
        raise fail(idx, "unterminated JSON array (missing ']')")


def _check_text_content(content: Any, field: str) -> None:
    if isinstance(content, str):
        return
    if isinstance(content, list):
        for i, part in enumerate(content):
            _expect(isinstance(part, dict), f"{field}[{i}]", "a content part object", part)
            _expect(part.get("type") == "text", f"{field}[{i}].type", "'text' (text-only pipeline)", part.get("type"))
            _expect(isinstance(part.get("text"), str), f"{field}[{i}].text", "a string", part.get("text"))
        return
    _expect(False, field, "a string or a list of text parts", content)


def _check_tool_calls(calls: Any, field: str) -> None:
    _expect(isinstance(calls, list), field, "a list of tool calls", calls)
    for i, call in enumerate(calls):
        where = f"{field}[{i}]"
        _expect(isinstance(call, dict), where, "a tool call object", call)
        function = call.get("function", call)
        fwhere = f"{where}.function" if "function" in call else where
        _expect(isinstance(function, dict), fwhere, "an object with name and arguments", function)
        _expect(
            isinstance(function.get("name"), str) and function.get("name"),
            f"{fwhere}.name",
            "a non-empty string",
            function.get("name"),
        )
        try:
            normalize_arguments(function.get("arguments"), f"{fwhere}.arguments")
        except ChatFormatError as exc:
            field_name, _, problem = str(exc).partition(": ")
            raise RowProblem(field_name, problem) from None


def validate_conversation(data: dict[str, Any]) -> None:
    """Raise :class:`RowProblem` for the first structural problem of a conversation row."""
    messages = data["messages"]
    _expect(isinstance(messages, list), "messages", "a list of messages", messages)
    if not messages:
        raise RowProblem("messages", "expected a non-empty list of messages, got an empty list")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        _expect(isinstance(message, dict), where, "a message object", message)
        role = message.get("role")
        _expect(role in KNOWN_ROLES, f"{where}.role", f"one of {list(KNOWN_ROLES)}", role)
        has_calls = role == "assistant" and bool(message.get("tool_calls"))
        if "content" not in message:
            if not has_calls:
                raise RowProblem(f"{where}.content", "expected a string, got nothing (the field is missing)")
        elif message["content"] is None:
            if not has_calls:
                raise RowProblem(f"{where}.content", "expected a string, got null")
        else:
            _check_text_content(message["content"], f"{where}.content")
        for key in ("name", "reasoning_content", "reasoning"):
            if message.get(key) is not None:
                _expect(isinstance(message[key], str), f"{where}.{key}", "a string", message[key])
        if role == "assistant" and message.get("tool_calls") is not None:
            _check_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if role != "assistant" and message.get("tool_calls"):
            raise RowProblem(f"{where}.tool_calls", f"only assistant messages carry tool calls, got one on {role!r}")
        if role == "tool" and message.get("tool_call_id") is not None:
            _expect(
                isinstance(message["tool_call_id"], (str, int)),
                f"{where}.tool_call_id",
                "a string",
                message["tool_call_id"],
            )
    tools = data.get("tools")
    if tools is not None:
        _expect(
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools),
            "tools",
            "a list of tool objects",
            tools,
        )


def validate_pretokenized(data: dict[str, Any], vocab_limit: int) -> None:
    """Raise :class:`RowProblem` unless ``input_ids`` are ints in ``[0, vocab_limit)`` and ``loss_mask`` (optional)
    is one 0/1 value per id."""
    ids = data["input_ids"]
    _expect(isinstance(ids, list) and len(ids) > 0, "input_ids", "a non-empty list of token ids", ids)
    for i, token in enumerate(ids):
        if not (isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_limit):
            _expect(False, f"input_ids[{i}]", f"an int in [0, {vocab_limit})", token)
    if data.get("loss_mask") is not None:
        mask = data["loss_mask"]
        _expect(isinstance(mask, list), "loss_mask", "a list of 0/1 values", mask)
        if len(mask) != len(ids):
            raise RowProblem("loss_mask", f"expected {len(ids)} values (one per input id), got {len(mask)}")
        for i, value in enumerate(mask):
            if value not in (0, 1) or isinstance(value, float):
                _expect(False, f"loss_mask[{i}]", "0 or 1", value)


def validate_row(data: Any, vocab_limit: int) -> str:
    """Validate a parsed row; returns its kind (``"chat"`` or ``"tokens"``) or raises :class:`RowProblem`."""
    _expect(isinstance(data, dict), "<row>", "a JSON object with 'messages' (or 'input_ids')", data)
    if "messages" in data and "input_ids" in data:
        raise RowProblem("<row>", "expected either 'messages' or 'input_ids', got both")
    if "messages" in data:
        validate_conversation(data)
        return "chat"
    if "input_ids" in data:
        validate_pretokenized(data, vocab_limit)
        return "tokens"
    raise RowProblem("messages", f"expected a list of messages (or 'input_ids'), got a row with keys {sorted(data)}")
