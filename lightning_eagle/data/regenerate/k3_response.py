"""Splitting the tokens a K3 target generated after the generation prompt into the message fields."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_eagle.data.render_k3 import CLOSE, END_OF_MSG, OPEN, SEP

_ATTR = re.compile(r'\s([\w-]+)="([^"]*)"')


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


@dataclass
class ParsedResponse:
    """The message fields recovered from a K3 generation (:func:`split_k3_response`)."""

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
