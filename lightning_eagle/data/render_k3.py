"""K3 XTML chat rendering, segment by segment, as the released K3 renderer (``encoding_k3.build_chat_segments``).

Every structural marker (``<|open|>``, ``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>``) is its own segment encoded
with specials allowed; tag names, attribute names/values and all content are separate text segments encoded with
specials *disallowed*, so marker text typed inside content becomes ordinary byte tokens. A header
``message role="assistant"`` is emitted as the segments ``message``, `` role``, ``="``, ``assistant``, ``"``
(golden ``chats.json``). Order: tool declaration, thinking-effort note, conversation, tool-choice /
response-format notes, generation prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"

# The reference validates the effort against these three although its note text also lists ``medium``.
THINKING_EFFORTS = ("low", "high", "max")
KNOWN_ROLES = ("system", "user", "assistant", "tool")
RENDER_OPTIONS = ("add_generation_prompt", "thinking", "thinking_effort", "tool_choice", "response_format")


class Segment(NamedTuple):
    """One rendered piece: ``allow_special`` for markers; ``is_assistant`` marks the reference's
    ``{% generation %}`` span (assistant body after the header, through ``<|close|>message<|sep|><|end_of_msg|>``)."""

    text: str
    allow_special: bool
    is_assistant: bool = False


class ChatFormatError(ValueError):
    """A conversation the K3 format cannot represent (bad role, unparsable tool arguments, ...)."""


def _text(text: Any, assistant: bool) -> list[Segment]:
    text = str(text)
    return [Segment(text, False, assistant)] if text else []


def _marker(marker: str, assistant: bool) -> list[Segment]:
    return [Segment(marker, True, assistant)]


def _escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open_tag(tag: str, attrs: Sequence[tuple[str, Any]] = (), assistant: bool = False) -> list[Segment]:
    segments = _marker(OPEN, assistant) + _text(tag, assistant)
    for key, value in attrs:
        segments += _text(f" {key}", assistant) + _text('="', assistant)
        segments += _text(_escape_attr(value), assistant) + _text('"', assistant)
    return segments + _marker(SEP, assistant)


def _close_tag(tag: str, assistant: bool = False) -> list[Segment]:
    return _marker(CLOSE, assistant) + _text(tag, assistant) + _marker(SEP, assistant)


def _end_message(assistant: bool = False) -> list[Segment]:
    return _close_tag("message", assistant) + _marker(END_OF_MSG, assistant)


def json_compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def deep_sort(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: deep_sort(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [deep_sort(v) for v in value]
    return value


def _internal_system_message(kind: str, body: str) -> list[Segment]:
    return _open_tag("message", [("role", "system"), ("type", kind)]) + _text(body.strip(), False) + _end_message()


def _tool_declare(tools: Any, *, dynamic: bool = False) -> list[Segment]:
    if dynamic:
        head = (
            "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
        )
    else:
        head = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
    return _internal_system_message("tool-declare", f"{head}```json\n{json_compact(deep_sort(tools))}\n```")


def _content(content: Any, assistant: bool, where: str) -> list[Segment]:
    if content is None:
        return []
    if isinstance(content, str):
        return _text(content, assistant)
    if isinstance(content, list):
        segments: list[Segment] = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                got = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatFormatError(f"{where}.content[{i}]: expected a text part, got {got!r} (text-only pipeline)")
            segments += _text(part["text"], assistant)
        return segments
    raise ChatFormatError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")


def xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def normalize_arguments(arguments: Any, where: str) -> tuple[dict[str, Any], str | None]:
    """Tool-call arguments -> (per-key values, raw block). Unparsable strings become a raw ``json`` block."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, None
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}, arguments
        if not isinstance(parsed, dict):
            raise ChatFormatError(f"{where}: expected a JSON object, got a JSON {type(parsed).__name__}")
        return parsed, None
    raise ChatFormatError(f"{where}: expected a dict or a JSON object string, got {type(arguments).__name__}")


def _function_of(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", call)
    return function if isinstance(function, dict) else {}


def _assistant_body(message: dict[str, Any], thinking: bool, where: str) -> list[Segment]:
    segments: list[Segment] = []
    if thinking:
        segments += _open_tag("think", assistant=True)
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning is not None and str(reasoning).strip():
            segments += _text(reasoning, True)
        segments += _close_tag("think", True)
    segments += _open_tag("response", assistant=True)
    segments += _content(message.get("content"), True, where)
    segments += _close_tag("response", True)
    calls = message.get("tool_calls") or []
    if calls:
        segments += _open_tag("tools", assistant=True)
        for index, call in enumerate(calls, start=1):
            call_where = f"{where}.tool_calls[{index - 1}]"
            function = _function_of(call)
            if not isinstance(function.get("name"), str):
                raise ChatFormatError(f"{call_where}.function.name: expected a string")
            arguments, raw = normalize_arguments(function.get("arguments"), f"{call_where}.function.arguments")
            segments += _open_tag("call", [("tool", function["name"]), ("index", index)], True)
            if raw is not None:
                segments += _open_tag("json", [("type", "object")], True) + _text(raw, True) + _close_tag("json", True)
            else:
                for key, value in arguments.items():
                    rendered = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                    segments += _open_tag("argument", [("key", key), ("type", xtml_type(value))], True)
                    segments += _text(rendered, True) + _close_tag("argument", True)
            segments += _close_tag("call", True)
        segments += _close_tag("tools", True)
    return segments


def _order_tool_results(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Put each run of tool results in the order of the preceding assistant's calls when every id matches."""
    out: list[dict[str, Any]] = []
    call_index: dict[str, tuple[int, str | None]] = {}
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") == "assistant":
            call_index = {}
            for position, call in enumerate(message.get("tool_calls") or [], start=1):
                if isinstance(call, dict) and call.get("id") is not None:
                    call_index.setdefault(str(call["id"]), (position, _function_of(call).get("name")))
        if message.get("role") != "tool":
            out.append(message)
            i += 1
            continue
        run: list[tuple[int, dict[str, Any]]] = []
        unresolved = False
        while i < len(messages) and messages[i].get("role") == "tool":
            tool_message = messages[i]
            call_id = tool_message.get("tool_call_id", tool_message.get("id"))
            target = call_index.get(str(call_id)) if call_id is not None else None
            if target is None:
                unresolved = True
                run.append((0, tool_message))
            else:
                resolved = dict(tool_message)
                if target[1] is not None:
                    resolved["tool"] = target[1]
                run.append((target[0], resolved))
            i += 1
        if not unresolved:
            run.sort(key=lambda item: item[0])
        out.extend(m for _, m in run)
    return out


def build_k3_segments(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    tool_choice: str | None = None,
    response_format: Any = None,
) -> list[Segment]:
    """Render a conversation to K3 segments. See :func:`render_k3_chat` for the options."""
    if not isinstance(messages, (list, tuple)):
        raise ChatFormatError(f"messages: expected a list, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatFormatError(f"messages[{i}]: expected an object, got {type(message).__name__}")
        if message.get("role") not in KNOWN_ROLES:
            raise ChatFormatError(
                f"messages[{i}].role: expected one of {list(KNOWN_ROLES)}, got {message.get('role')!r}"
            )
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ChatFormatError(
            f"thinking_effort: expected one of {list(THINKING_EFFORTS)} or None, got {thinking_effort!r}"
        )

    segments: list[Segment] = []
    if tools:
        segments += _tool_declare(tools)
    if thinking and thinking_effort:
        segments += _internal_system_message(
            "thinking-effort",
            "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
            "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={thinking_effort}`.",
        )

    prior_calls: list[Any] = []
    tool_index = 0
    for i, message in enumerate(_order_tool_results(list(messages))):
        role, where = message["role"], f"messages[{i}]"
        if role == "system" and message.get("tools"):
            segments += _tool_declare(message["tools"], dynamic=True)
        elif role in ("system", "user"):
            attrs: list[tuple[str, Any]] = [("role", role)]
            if message.get("name"):
                attrs.append(("name", message["name"]))
            segments += _open_tag("message", attrs) + _content(message.get("content"), False, where) + _end_message()
        elif role == "assistant":
            prior_calls, tool_index = list(message.get("tool_calls") or []), 0
            segments += _open_tag("message", [("role", "assistant")])
            segments += _assistant_body(message, thinking, where) + _end_message(True)
        else:  # tool
            tool_index += 1
            name = message.get("tool", message.get("name"))
            if name is None and tool_index <= len(prior_calls):
                name = _function_of(prior_calls[tool_index - 1]).get("name")
            if name is None:
                raise ChatFormatError(
                    f"{where}: tool result has no resolvable tool name (no matching tool_call_id): expected a 'name' "
                    f"field or an earlier assistant message with tool_calls, got {len(prior_calls)} call(s) for "
                    f"{tool_index} tool result(s)"
                )
            segments += _open_tag("message", [("role", "tool"), ("tool", name), ("index", tool_index)])
            segments += _content(message.get("content"), False, where) + _end_message()

    if tool_choice not in (None, "auto", "required", "none"):
        raise ChatFormatError(f"tool_choice: expected None, 'auto', 'required' or 'none', got {tool_choice!r}")
    if tool_choice in ("required", "none"):
        requirement = "call tools" if tool_choice == "required" else "NOT call any tools"
        segments += _internal_system_message(
            "tool-choice",
            f"The system is invoked with `tool_choice={tool_choice}`.\nYou MUST {requirement} in the next message.",
        )
    response_type = response_format.get("type") if isinstance(response_format, dict) else response_format
    if response_type not in (None, "text"):
        body = (
            f"The system is invoked with `response_format={response_type}`.\n"
            "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
        )
        if response_type == "json_schema":
            schema = response_format.get("json_schema") if isinstance(response_format, dict) else None
            if isinstance(schema, dict):
                schema = schema.get("schema", schema.get("json_schema", schema))
            body += f"\nThe JSON data must match the following schema:\n```json\n{json_compact(deep_sort(schema))}\n```"
        elif response_type != "json_object":
            raise ChatFormatError(f"response_format: expected json_object or json_schema, got {response_type!r}")
        segments += _internal_system_message("response-format", body)

    if add_generation_prompt:
        segments += _open_tag("message", [("role", "assistant")])
        segments += _open_tag("think" if thinking else "response")
    return segments


def encode_segments(tokenizer: Any, segments: Sequence[Segment]) -> list[int]:
    """Encode segment by segment: ours via ``encode_segments``; any tokenizer whose ``encode`` takes
    ``allow_special_tokens`` (the released ``TikTokenTokenizer`` does) through that."""
    if hasattr(tokenizer, "encode_segments"):
        return tokenizer.encode_segments(segments)
    ids: list[int] = []
    for segment in segments:
        if segment.text:
            ids += tokenizer.encode(segment.text, allow_special_tokens=segment.allow_special)
    return ids


def validate_render_options(**options: Any) -> None:
    """Raise now (TypeError / ChatFormatError) for options that would fail on every row."""
    _check_options(options, "validate_render_options")
    build_k3_segments([{"role": "user", "content": "x"}], **options)


def _check_options(options: dict[str, Any], caller: str) -> None:
    unknown = sorted(set(options) - set(RENDER_OPTIONS))
    if unknown:
        raise TypeError(f"{caller}() got unknown option(s) {unknown}; supported: {list(RENDER_OPTIONS)}")


def render_k3_chat(
    messages: Sequence[dict[str, Any]],
    tokenizer: Any,
    tools: Sequence[dict[str, Any]] | None = None,
    **options: Any,
) -> list[int]:
    """Render and tokenize a conversation in K3 XTML; returns token ids.

    Options (the reference chat template's keyword arguments and meanings):

    * ``thinking=True`` - assistant turns carry a ``think`` block (empty when there is no reasoning) and the
      generation prompt opens ``think``; ``False`` drops reasoning and opens ``response``.
    * ``thinking_effort="max"`` - the reference's default; adds a ``role="system" type="thinking-effort"`` note
      when thinking is on. ``None`` omits the note. Accepted values: ``low``, ``high``, ``max``.
    * ``add_generation_prompt=False`` - **our default for training** (the reference's ``apply_chat_template``
      defaults to True; the golden file records ``add_generation_prompt: True`` explicitly where it is used).
    * ``tool_choice`` (``"required"``/``"none"`` add a note) and ``response_format`` (``json_object`` /
      ``json_schema``) - request-scoped notes after the conversation, as in the reference.

    ``tools`` (OpenAI-style declarations) adds the ``tool-declare`` system message first. Unknown options raise
    ``TypeError``.
    """
    _check_options(options, "render_k3_chat")
    return encode_segments(tokenizer, build_k3_segments(messages, tools, **options))


def render_k3_text(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None, **options) -> str:
    """The rendered text (markers spelled out); not re-tokenizable safely - use :func:`render_k3_chat` for ids."""
    _check_options(options, "render_k3_text")
    return "".join(s.text for s in build_k3_segments(messages, tools, **options))


def render_k3_chat_with_assistant_mask(
    messages: Sequence[dict[str, Any]],
    tokenizer: Any,
    tools: Sequence[dict[str, Any]] | None = None,
    **options: Any,
) -> tuple[list[int], list[int]]:
    """Ids plus the renderer-side ``{% generation %}`` mask (golden ``assistant_mask_peer``).

    This is what a fast tokenizer's ``return_assistant_tokens_mask`` would give; training uses the token-level
    recovery instead (``get_loss_mask_recovery``), which works on any id sequence, including pre-tokenized data.
    """
    _check_options(options, "render_k3_chat_with_assistant_mask")
    ids: list[int] = []
    mask: list[int] = []
    for segment in build_k3_segments(messages, tools, **options):
        if not segment.text:
            continue
        piece = tokenizer.encode(segment.text, allow_special_tokens=segment.allow_special)
        ids += piece
        mask += [int(segment.is_assistant)] * len(piece)
    return ids, mask
