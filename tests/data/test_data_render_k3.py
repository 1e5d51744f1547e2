"""K3 XTML rendering against the golden reference renderings, plus option and error behaviour."""

from __future__ import annotations

import pytest

from lightning_eagle.data import (
    ChatFormatError,
    build_k3_segments,
    render_k3_chat,
    render_k3_chat_with_assistant_mask,
    render_k3_text,
)
from lightning_eagle.data.render_k2 import build_k2_segments, render_k2_chat


def _cases(golden_chats):
    return {case["name"]: case for case in golden_chats["cases"]}


def _render(case, tok):
    return render_k3_chat(case["messages"], tok, tools=case["tools"], **case["apply_chat_template_kwargs"])


def test_golden_has_the_documented_cases(golden_chats):
    assert set(_cases(golden_chats)) == {
        "system_user_assistant_thinking_nested_tags",
        "multi_turn_tool_calls_out_of_order_results",
        "non_thinking_named_user_generation_prompt",
        "default_thinking_effort_max_and_generation_prompt",
    }


def test_golden_input_ids_identical(golden_chats, k3_tok):
    for case in golden_chats["cases"]:
        assert _render(case, k3_tok) == case["input_ids"], case["name"]


def test_golden_segments_and_text_identical(golden_chats, k3_tok):
    for case in golden_chats["cases"]:
        segments = build_k3_segments(case["messages"], case["tools"], **case["apply_chat_template_kwargs"])
        assert [list(s) for s in segments] == case["segments"], case["name"]
        text = render_k3_text(case["messages"], case["tools"], **case["apply_chat_template_kwargs"])
        assert text == case["rendered_text"] == k3_tok.decode(case["input_ids"])


def test_golden_decoded_tokens(golden_chats, k3_tok):
    for case in golden_chats["cases"]:
        assert [k3_tok.decode([i]) for i in case["input_ids"]] == case["decoded_tokens"], case["name"]


def test_renderer_generation_span_equals_golden_peer_mask(golden_chats, k3_tok):
    for case in golden_chats["cases"]:
        ids, mask = render_k3_chat_with_assistant_mask(
            case["messages"], k3_tok, tools=case["tools"], **case["apply_chat_template_kwargs"]
        )
        assert ids == case["input_ids"]
        assert mask == case["assistant_mask_peer"], case["name"]


def test_literal_markers_in_content_are_ordinary_bytes(golden_chats, k3_tok):
    case = _cases(golden_chats)["system_user_assistant_thinking_nested_tags"]
    ids = _render(case, k3_tok)
    # Real <|open|> ids: 3 messages + think + response openers; the two typed in content stay bytes.
    assert ids.count(259) == 5
    assert k3_tok.decode(ids).count("<|open|>") == 6


def test_defaults_thinking_on_effort_max_no_generation_prompt(k3_tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    text = render_k3_text(messages)
    assert text.startswith('<|open|>message role="system" type="thinking-effort"<|sep|>')
    assert "`thinking_effort=max`" in text
    assert text.endswith(
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
        "<|open|>response<|sep|>Yo<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    assert render_k3_chat(messages, k3_tok) == k3_tok.encode_segments(build_k3_segments(messages))


def test_thinking_off_drops_reasoning_and_effort_note():
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "reasoning_content": "R", "content": "A"}]
    text = render_k3_text(messages, thinking=False)
    assert "thinking-effort" not in text and "<|open|>think" not in text
    assert all(s.text != "R" for s in build_k3_segments(messages, thinking=False))
    prompt = render_k3_text(messages, thinking=False, add_generation_prompt=True)
    assert prompt.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')


def test_effort_levels_and_validation():
    messages = [{"role": "user", "content": "Q"}]
    assert "`thinking_effort=low`" in render_k3_text(messages, thinking_effort="low")
    with pytest.raises(ChatFormatError, match="thinking_effort: expected one of"):
        render_k3_text(messages, thinking_effort="medium")
    assert "thinking-effort" not in render_k3_text(messages, thinking=False, thinking_effort="bogus")


def test_unknown_option_raises(k3_tok):
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['return_assistant_tokens_mask'\]"):
        render_k3_chat([{"role": "user", "content": "x"}], k3_tok, return_assistant_tokens_mask=False)


def test_attribute_values_are_escaped_and_names_rendered():
    text = render_k3_text([{"role": "user", "name": 'a"b&c', "content": "x"}], thinking_effort=None)
    assert text.startswith('<|open|>message role="user" name="a&quot;b&amp;c"<|sep|>x')


def test_tool_call_argument_types():
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "function": {"name": "f", "arguments": {"s": "x", "n": 1.5, "b": False, "z": None}}},
                {"id": "c2", "function": {"name": "g", "arguments": '{"o": {"k": [1]}}'}},
                {"id": "c3", "function": {"name": "h", "arguments": ""}},
            ],
        },
    ]
    text = render_k3_text(messages, thinking_effort=None)
    assert '<|open|>argument key="s" type="string"<|sep|>x<|close|>argument<|sep|>' in text
    assert '<|open|>argument key="n" type="number"<|sep|>1.5<|close|>argument<|sep|>' in text
    assert '<|open|>argument key="b" type="boolean"<|sep|>false<|close|>argument<|sep|>' in text
    assert '<|open|>argument key="z" type="null"<|sep|>null<|close|>argument<|sep|>' in text
    assert '<|open|>argument key="o" type="object"<|sep|>{"k": [1]}<|close|>argument<|sep|>' in text
    assert '<|open|>call tool="h" index="3"<|sep|><|close|>call<|sep|>' in text


def test_tool_results_reordered_by_call_and_named_from_the_call():
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "function": {"name": "first", "arguments": "{}"}},
                {"id": "b", "function": {"name": "second", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
    ]
    text = render_k3_text(messages, thinking_effort=None)
    first = text.index('message role="tool" tool="first" index="1"<|sep|>A')
    second = text.index('message role="tool" tool="second" index="2"<|sep|>B')
    assert first < second


def test_unresolvable_tool_result_raises():
    with pytest.raises(ChatFormatError, match="no resolvable tool name"):
        render_k3_text([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([{"role": "bot", "content": "x"}], "messages[0].role: expected one of"),
        ([{"role": "user", "content": 3}], "messages[0].content: expected a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]: expected a text part"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
            "expected a JSON object, got a JSON list",
        ),
    ],
)
def test_render_errors(messages, fragment):
    with pytest.raises(ChatFormatError) as info:
        render_k3_text(messages)
    assert fragment in str(info.value)


def test_request_notes_and_dynamic_tools():
    messages = [{"role": "system", "tools": [{"b": 1, "a": 2}], "content": ""}, {"role": "user", "content": "x"}]
    text = render_k3_text(
        messages, thinking_effort=None, tool_choice="required", response_format={"type": "json_object"}
    )
    assert '"a":2,"b":1' in text and "## New Tools Available" in text
    assert "`tool_choice=required`" in text and "`response_format=json_object`" in text
    with pytest.raises(ChatFormatError, match="tool_choice"):
        render_k3_text(messages, tool_choice={"name": "f"})


def test_k2_rendering_structure(k3_tok):
    from lightning_eagle.data import synthetic_k2_tokenizer

    tok = synthetic_k2_tokenizer()
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U <|im_end|>"},
        {"role": "assistant", "content": "A"},
    ]
    text = "".join(s.text for s in build_k2_segments(messages, add_generation_prompt=True))
    assert text == (
        "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>U <|im_end|><|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>A<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    ids = render_k2_chat(messages, tok)
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 3  # the typed one is bytes


def test_tokenizers_without_encode_segments_are_encoded_per_segment(golden_chats, k3_tok):
    """The released TikTokenTokenizer has ``encode(text, allow_special_tokens=...)`` but no ``encode_segments``."""

    class EncodeOnly:
        def encode(self, text, allow_special_tokens=True):
            return k3_tok.encode(text, allow_special_tokens=allow_special_tokens)

    for case in golden_chats["cases"]:
        assert _render(case, EncodeOnly()) == case["input_ids"]
