"""K2 chat rendering (``<|im_*|>`` turns), used to exercise the ``kimi`` loss-mask recovery.

A turn is ``<|im_{role}|>{name}<|im_middle|>{content}<|im_end|>`` (system turns and tool results use
``<|im_system|>``). This follows the structure of the K2 Jinja template but is not byte-verified against a released
K2 tokenizer and omits its default system prompt; training K3 drafts never uses it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from lightning_eagle.data.render_k3 import KNOWN_ROLES, ChatFormatError, Segment, encode_segments

_ROLE_MARKER = {
    "system": "<|im_system|>",
    "user": "<|im_user|>",
    "assistant": "<|im_assistant|>",
    "tool": "<|im_system|>",
}


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ChatFormatError(f"{where}.content: expected a string or a list of text parts")


def build_k2_segments(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    thinking: bool = False,
) -> list[Segment]:
    """K2 segments; ``thinking`` prefixes assistant content with ``<think>reasoning</think>`` (ordinary text)."""
    segments: list[Segment] = []

    def marker(m: str, assistant: bool = False) -> None:
        segments.append(Segment(m, True, assistant))

    def text(t: str, assistant: bool = False) -> None:
        if t:
            segments.append(Segment(t, False, assistant))

    if tools:
        marker("<|im_system|>")
        text("tool_declare")
        marker("<|im_middle|>")
        text(json.dumps(list(tools), ensure_ascii=False))
        marker("<|im_end|>")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in KNOWN_ROLES:
            raise ChatFormatError(f"{where}.role: expected one of {list(KNOWN_ROLES)}, got {role!r}")
        marker(_ROLE_MARKER[role])
        text(message.get("name") or role)
        marker("<|im_middle|>")
        is_assistant = role == "assistant"
        if is_assistant and thinking:
            reasoning = message.get("reasoning_content") or ""
            text(f"<think>{reasoning}</think>", True)
        if role == "tool":
            text(f"## Return of {message.get('tool_call_id', '')}\n{_content_text(message.get('content'), where)}")
        else:
            text(_content_text(message.get("content"), where), is_assistant)
        calls = (message.get("tool_calls") or []) if is_assistant else []
        if calls:
            marker("<|tool_calls_section_begin|>", True)
            for index, call in enumerate(calls):
                function = call.get("function", call)
                call_id = call.get("id") or f"functions.{function.get('name')}:{index}"
                arguments = function.get("arguments")
                marker("<|tool_call_begin|>", True)
                text(str(call_id), True)
                marker("<|tool_call_argument_begin|>", True)
                text(arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False), True)
                marker("<|tool_call_end|>", True)
            marker("<|tool_calls_section_end|>", True)
        marker("<|im_end|>")
    if add_generation_prompt:
        marker("<|im_assistant|>")
        text("assistant")
        marker("<|im_middle|>")
    return segments


def render_k2_chat(
    messages: Sequence[dict[str, Any]],
    tokenizer: Any,
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    thinking: bool = False,
) -> list[int]:
    """Render and tokenize a conversation in the K2 format (markers special, text ordinary)."""
    segments = build_k2_segments(messages, tools, add_generation_prompt=add_generation_prompt, thinking=thinking)
    return encode_segments(tokenizer, segments)
