"""Loss-mask recovery registry and the chat spec §8 test matrix (numbers in test names refer to its rows)."""

from __future__ import annotations

import pytest
import torch

from lightning_eagle.data import (
    LossMaskRecovery,
    get_loss_mask_recovery,
    load_kimi_tokenizer,
    register_loss_mask_recovery,
    render_k2_chat,
    render_k3_chat,
    synthetic_k2_tokenizer,
    synthetic_k3_tokenizer,
)
from lightning_eagle.data.loss_mask import (
    K2_MARKERS,
    KIMI_K2,
    KIMI_K3,
    XTML_MARKERS,
    get_loss_mask_recovery_by_name,
    has_all_tokens,
    parse_header,
    registered_loss_mask_recoveries,
)
from lightning_eagle.data.tokenizer_files import K2_DEFAULT_ADDITIONAL_SPECIAL_TOKENS, save_tokenizer_dir

MARKER_NAMES = set(XTML_MARKERS)


def ids_of(tok, *parts):
    """Concatenate parts: XTML marker names as special ids, anything else as ordinary text."""
    out = []
    for part in parts:
        if part in MARKER_NAMES:
            out.append(tok.convert_tokens_to_ids(part))
        else:
            out += tok.encode(part, allow_special_tokens=False)
    return out


def header(tok, tag, **attrs):
    text = tag + "".join(f' {k}="{v}"' for k, v in attrs.items())
    return ids_of(tok, "<|open|>", text, "<|sep|>")


def close(tok, tag):
    return ids_of(tok, "<|close|>", tag, "<|sep|>")


def message(tok, role, *body, eom=True):
    out = header(tok, "message", role=role)
    for part in body:
        out += part if isinstance(part, list) else ids_of(tok, part)
    out += close(tok, "message")
    return out + (ids_of(tok, "<|end_of_msg|>") if eom else [])


def nested(tok, tag, text):
    return header(tok, tag) + ids_of(tok, text) + close(tok, tag)


def mask_of(tok, ids, **options):
    return KIMI_K3.compute(tok, ids, **options).tolist()


def ones(mask):
    return [i for i, m in enumerate(mask) if m]


# ----------------------------------------------------------------------------------------------- detection (1-3)


def test_01_k3_tokenizer_selects_kimi_k3(k3_tok):
    assert get_loss_mask_recovery(k3_tok).name == "kimi_k3"


def test_02_dual_marker_tokenizer_selects_kimi_k3(tmp_path, k3_tok):
    trap = synthetic_k3_tokenizer(added_tokens=K2_DEFAULT_ADDITIONAL_SPECIAL_TOKENS)
    assert has_all_tokens(trap, K2_MARKERS) and has_all_tokens(trap, XTML_MARKERS)
    assert get_loss_mask_recovery(trap).name == "kimi_k3"
    assert not KIMI_K2.detect(trap)  # kimi defers even when asked directly
    # The same through the real loading path: a config without additional_special_tokens.
    loaded = load_kimi_tokenizer(save_tokenizer_dir(k3_tok, tmp_path / "trap", write_additional=False))
    assert has_all_tokens(loaded, K2_MARKERS)
    assert get_loss_mask_recovery(loaded).name == "kimi_k3"


def test_03_k2_unknown_and_raising_tokenizers(fake_k2_tok):
    assert get_loss_mask_recovery(synthetic_k2_tokenizer()).name == "kimi"
    assert get_loss_mask_recovery(fake_k2_tok).name == "kimi"

    class Unknown:
        unk_token_id = 0

        def convert_tokens_to_ids(self, token):
            return 0

    class Raising:
        def convert_tokens_to_ids(self, token):
            raise RuntimeError("boom")

    class ReturnsNone:
        unk_token_id = 7

        def convert_tokens_to_ids(self, token):
            return None

    assert get_loss_mask_recovery(Unknown()) is None
    assert get_loss_mask_recovery(Raising()) is None
    assert get_loss_mask_recovery(ReturnsNone()) is None


def test_registration_order_and_custom_recovery(restore_registry, fake_k2_tok):
    assert [r.name for r in registered_loss_mask_recoveries()][:2] == ["kimi_k3", "kimi"]
    custom = LossMaskRecovery(
        "everything",
        detect=lambda tok: True,
        compute=lambda tok, ids: torch.ones(len(list(ids)), dtype=torch.long),
    )
    register_loss_mask_recovery(custom)
    assert get_loss_mask_recovery(fake_k2_tok).name == "kimi"  # first match wins; custom is last
    assert get_loss_mask_recovery(object()).name == "everything"
    assert get_loss_mask_recovery_by_name("everything") is custom
    with pytest.raises(ValueError, match="already registered"):
        register_loss_mask_recovery(custom)


def test_registry_fixture_restored():
    assert [r.name for r in registered_loss_mask_recoveries()] == ["kimi_k3", "kimi"]


# ----------------------------------------------------------------------------------------------- PR-2049 fixture (4-6)

# Fake ids: <|open|> 10, <|close|> 11, <|sep|> 12; words message 100, role 101, assistant 102, user 103, think 104.
USER_MSG = [10, 100, 101, 103, 12, 200, 11, 100, 12]
ASSISTANT_MSG = [10, 100, 101, 102, 12, 300, 301, 11, 100, 12]


def test_04_user_then_assistant_marks_exactly_the_content(fake_xtml_tok):
    ids = USER_MSG + ASSISTANT_MSG
    mask = KIMI_K3.compute(fake_xtml_tok, torch.tensor(ids)).tolist()
    assert [ids[i] for i in ones(mask)] == [300, 301]
    assert ones(mask) == [len(USER_MSG) + 5, len(USER_MSG) + 6]


def test_05_nested_think_block_is_inside_the_span(fake_xtml_tok):
    ids = [10, 100, 101, 102, 12, 200, 10, 104, 12, 201, 11, 104, 12, 202, 11, 100, 12]
    mask = KIMI_K3.compute(fake_xtml_tok, ids).tolist()
    assert mask[:5] == [0] * 5 and mask[-3:] == [0] * 3
    assert mask[5:-3] == [1] * (len(ids) - 8)


def test_06_list_input(fake_xtml_tok):
    assert KIMI_K3.compute(fake_xtml_tok, ASSISTANT_MSG).tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]


# ----------------------------------------------------------------------------------------------- headers (7-9)


def test_07_multi_token_headers_with_quoting(k3_tok, k3_words_tok):
    for tok in (k3_tok, k3_words_tok):
        ids = message(tok, "assistant", "x")
        start = len(header(tok, "message", role="assistant"))
        assert ones(mask_of(tok, ids)) == [start]
        assert len(header(tok, "message", role="assistant")) >= 7  # open + >= 5 header tokens + sep
    # Extra attributes, escaped quotes and the bare form parse to the same role.
    assert parse_header('message role="assistant" name="a&quot;b"') == ("message", {"role": "assistant", "name": 'a"b'})
    assert parse_header("  message   role assistant ") == ("message", {"role": "assistant"})
    assert parse_header('message type="x" role = "Assistant"')[1]["role"] == "Assistant"
    assert parse_header('call tool="assistant"') == ("call", {"tool": "assistant"})
    # Case-insensitive role value, as the spec's casefold comparison.
    ids = ids_of(k3_tok, "<|open|>", 'message role="ASSISTANT"', "<|sep|>", "y", "<|close|>", "message", "<|sep|>")
    assert len(ones(mask_of(k3_tok, ids))) == 1


def test_08_name_assistant_on_user_message_is_not_assistant(k3_tok):
    ids = ids_of(k3_tok, "<|open|>", 'message role="user" name="assistant"', "<|sep|>", "hi")
    ids += close(k3_tok, "message") + ids_of(k3_tok, "<|end_of_msg|>")
    assert sum(mask_of(k3_tok, ids)) == 0
    messages = [{"role": "user", "name": "assistant", "content": "I am the assistant"}]
    assert sum(mask_of(k3_tok, render_k3_chat(messages, k3_tok))) == 0


def test_09_literal_markers_typed_in_user_text(k3_tok):
    typed = '<|open|>message role="assistant"<|sep|>fake<|close|>message<|sep|>'
    messages = [{"role": "user", "content": typed}, {"role": "assistant", "content": "real"}]
    ids = render_k3_chat(messages, k3_tok, thinking=False, thinking_effort=None)
    mask = mask_of(k3_tok, ids)
    assert k3_tok.decode([ids[i] for i in ones(mask)]) == "<|open|>response<|sep|>real<|close|>response<|sep|>"
    user_ids = render_k3_chat(messages[:1], k3_tok, thinking_effort=None)
    assert sum(mask_of(k3_tok, user_ids)) == 0


# ----------------------------------------------------------------------------------------------- nesting (10)


def test_10_think_response_tools_nested_whole_span(k3_tok):
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "reasoning_content": "r",
            "content": "c",
            "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"k": "v"}'}}],
        },
    ]
    from lightning_eagle.data import render_k3_chat_with_assistant_mask

    ids, peer = render_k3_chat_with_assistant_mask(messages, k3_tok, thinking_effort=None)
    mask = mask_of(k3_tok, ids)
    trailer = len(close(k3_tok, "message")) + 1
    expected = list(peer)
    expected[len(ids) - trailer :] = [0] * trailer
    assert mask == expected
    body = k3_tok.decode([ids[i] for i in ones(mask)])
    assert body.startswith("<|open|>think<|sep|>r<|close|>think<|sep|><|open|>response<|sep|>c")
    argument = '<|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>'
    assert body.endswith(argument + "<|close|>call<|sep|><|close|>tools<|sep|>")


# ----------------------------------------------------------------------------------------------- truncation (11-15)


def _assistant(tok, thinking=True):
    return render_k3_chat(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "reasoning_content": "think hard", "content": "answer"},
        ],
        tok,
        thinking=thinking,
        thinking_effort=None,
    )


def test_11_truncated_mid_content_masks_to_end(k3_tok):
    full = _assistant(k3_tok)
    cut = full[: full.index(k3_tok.encode("answer")[0]) + 3]  # inside "answer"
    mask = mask_of(k3_tok, cut)
    start = len(message(k3_tok, "user", "q")) + len(header(k3_tok, "message", role="assistant"))
    assert ones(mask) == list(range(start, len(cut)))


def test_12a_content_then_cut_inside_a_later_opener_header(k3_tok):
    full = _assistant(k3_tok)
    start = len(message(k3_tok, "user", "q")) + len(header(k3_tok, "message", role="assistant"))
    resp = full.index(260, start) + len(close(k3_tok, "think"))  # after <|close|>think<|sep|>
    cut = full[: resp + 4]
    assert k3_tok.decode(cut[resp:]) == "<|open|>res"
    mask = mask_of(k3_tok, cut)
    assert ones(mask) == list(range(start, len(cut)))  # partial opener tokens included


def test_12b_cut_inside_first_opener_without_content_is_all_zero(k3_tok):
    full = _assistant(k3_tok, thinking=False)
    start = len(message(k3_tok, "user", "q")) + len(header(k3_tok, "message", role="assistant"))
    cut = full[: start + 1 + len("respo")]
    assert k3_tok.decode(cut[start:]) == "<|open|>respo"
    assert sum(mask_of(k3_tok, cut)) == 0
    assert ones(mask_of(k3_tok, cut, drop_scaffold_only_tail=False)) == list(range(start, len(cut)))


def test_13_truncated_mid_message_header(k3_tok):
    first = message(k3_tok, "assistant", "ok")
    ids = first + header(k3_tok, "message", role="assistant")[:6]
    mask = mask_of(k3_tok, ids)
    assert sum(mask[len(first) :]) == 0
    assert sum(mask[: len(first)]) == 2  # the complete earlier message is still masked


def test_14_trailing_generation_prompt_is_not_supervised(k3_words_tok):
    tok = k3_words_tok
    messages = [{"role": "user", "content": "Hi"}]
    ids = render_k3_chat(messages, tok, thinking=False, thinking_effort=None, add_generation_prompt=True)
    assert tok.decode(ids[-3:]) == "<|open|>response<|sep|>"
    assert sum(mask_of(tok, ids)) == 0
    # Without the refinement we get the PR-2049 behaviour: the 3 scaffold tokens.
    assert ones(mask_of(tok, ids, drop_scaffold_only_tail=False)) == [len(ids) - 3, len(ids) - 2, len(ids) - 1]


def test_15_no_assistant_turn_is_all_zero(k3_tok):
    ids = message(k3_tok, "system", "s") + message(k3_tok, "user", "u") + message(k3_tok, "tool", "assistant")
    assert sum(mask_of(k3_tok, ids)) == 0


# ----------------------------------------------------------------------------------------------- malformed (16-17)


def test_16_stray_close_before_first_message_is_ignored(k3_tok):
    body = message(k3_tok, "assistant", "ok")
    ids = ids_of(k3_tok, "<|close|>", "junk", "<|sep|>") + body
    offset = len(ids) - len(body)
    assert ones(mask_of(k3_tok, ids)) == [i + offset for i in ones(mask_of(k3_tok, body))]


def test_17_unclosed_think_ends_at_end_of_msg(k3_tok):
    assistant = header(k3_tok, "message", role="assistant") + header(k3_tok, "think") + ids_of(k3_tok, "unfinished")
    eom = len(assistant)
    ids = assistant + ids_of(k3_tok, "<|end_of_msg|>") + message(k3_tok, "user", "next")
    mask = mask_of(k3_tok, ids)
    assert ones(mask) == list(range(len(header(k3_tok, "message", role="assistant")), eom))
    assert sum(mask[eom:]) == 0


def test_header_interrupted_by_another_marker_resumes_at_it(k3_tok):
    ids = ids_of(k3_tok, "<|open|>", "mess") + message(k3_tok, "assistant", "ok")
    assert len(ones(mask_of(k3_tok, ids))) == 2


def test_non_assistant_interiors_are_skipped_whole(k3_tok):
    inner = header(k3_tok, "message", role="assistant") + ids_of(k3_tok, "x") + close(k3_tok, "message")
    ids = message(k3_tok, "tool", inner)
    assert sum(mask_of(k3_tok, ids)) == 0


# ----------------------------------------------------------------------------------------------- options (18-19)


def test_18_multi_turn_and_last_turn_only(k3_tok):
    ids = (
        message(k3_tok, "user", "a")
        + message(k3_tok, "assistant", "AB")
        + message(k3_tok, "user", "c")
        + message(k3_tok, "assistant", "DEF")
    )
    assert k3_tok.decode([ids[i] for i in ones(mask_of(k3_tok, ids))]) == "ABDEF"
    assert k3_tok.decode([ids[i] for i in ones(mask_of(k3_tok, ids, last_turn_only=True))]) == "DEF"


def _worked_example(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids = render_k3_chat(messages, tok, thinking=False, thinking_effort=None)
    names = [tok.convert_ids_to_tokens(i) for i in ids]
    assert len(ids) == 30, names  # one token per cell of the §6.9 table
    return ids


def test_19_worked_example_and_options(k3_words_tok):
    tok = k3_words_tok
    ids = _worked_example(tok)
    assert ones(mask_of(tok, ids)) == list(range(19, 26))
    assert ones(mask_of(tok, ids, include_generation_scaffold=False)) == list(range(22, 26))
    assert ones(mask_of(tok, ids, include_trailer=True)) == list(range(19, 29))
    both = mask_of(tok, ids, include_generation_scaffold=False, include_trailer=True)
    assert ones(both) == list(range(22, 29)) and both[29] == 0


def test_scaffold_option_only_strips_think_or_response_openers(k3_tok):
    ids = message(k3_tok, "assistant", nested(k3_tok, "tools", "x"))
    assert mask_of(k3_tok, ids, include_generation_scaffold=False) == mask_of(k3_tok, ids)


# ----------------------------------------------------------------------------------------------- shapes (20-22)


def test_20_batches_raise_and_compute_batch_pads_zero(k3_tok):
    row = message(k3_tok, "assistant", "ok")
    truncated = row[:-5]  # assistant content cut: mask runs to the end of the real tokens
    pad = k3_tok.pad_token_id
    length = len(row) + 3
    right = truncated + [pad] * (length - len(truncated))
    left = [pad] * (length - len(row)) + row
    batch = torch.tensor([right, left])
    with pytest.raises(ValueError, match="1-D"):
        KIMI_K3.compute(k3_tok, batch)
    with pytest.raises(ValueError, match="1-D"):
        KIMI_K3.compute(k3_tok, [right, left])
    out = KIMI_K3.compute_batch(k3_tok, batch)
    assert out.shape == batch.shape and out.dtype == torch.long
    assert out[0].tolist() == mask_of(k3_tok, truncated) + [0] * (length - len(truncated))
    assert out[1].tolist() == [0] * (length - len(row)) + mask_of(k3_tok, row)
    assert sum(out[0, len(truncated) :].tolist()) == 0 and sum(mask_of(k3_tok, truncated)) > 0
    with pytest.raises(ValueError, match="2-D"):
        KIMI_K3.compute_batch(k3_tok, torch.tensor(row))
    # A right-padded trailing generation prompt stays scaffold-only: padding is not content.
    prompt = header(k3_tok, "message", role="assistant") + header(k3_tok, "response")
    assert sum(mask_of(k3_tok, prompt + [pad] * 4)) == 0


def test_21_list_and_tensor_inputs_agree(k3_tok, golden_chats):
    for case in golden_chats["cases"]:
        ids = case["input_ids"]
        assert torch.equal(KIMI_K3.compute(k3_tok, ids), KIMI_K3.compute(k3_tok, torch.tensor(ids)))
        assert torch.equal(KIMI_K3.compute(k3_tok, ids), KIMI_K3.compute(k3_tok, tuple(ids)))


@pytest.mark.parametrize("n", [0, 1, 5, 17, 40])
def test_22_length_and_dtype(k3_tok, fake_k2_tok, n):
    base = message(k3_tok, "assistant", "hello world") * 3
    for recovery, tok, ids in (
        (KIMI_K3, k3_tok, base[:n]),
        (KIMI_K2, fake_k2_tok, ([2, 50, 4, 300, 5, 1, 50] * 6)[:n]),
    ):
        out = recovery.compute(tok, ids)
        assert out.dtype == torch.long and out.shape == (n,)
        out = recovery.compute(tok, torch.tensor(ids, dtype=torch.long))
        assert out.dtype == torch.long and out.shape == (n,)


# ----------------------------------------------------------------------------------------------- K2 (23)

S, U, A, M, E, NAME = 3, 1, 2, 4, 5, 50  # fake K2 ids: system, user, assistant, middle, end, role-name stand-in


def test_23_k2_reference_cases(fake_k2_tok):
    tok = fake_k2_tok
    five_turns = [
        S,
        NAME,
        M,
        100,
        E,
        U,
        NAME,
        M,
        200,
        E,
        A,
        NAME,
        M,
        300,
        301,
        E,
        U,
        NAME,
        M,
        201,
        E,
        A,
        NAME,
        M,
        302,
        E,
    ]
    mask = KIMI_K2.compute(tok, five_turns).tolist()
    assert [five_turns[i] for i in ones(mask)] == [300, 301, 302]
    # Trailing generation prompt: nothing.
    assert sum(KIMI_K2.compute(tok, [U, NAME, M, 200, E, A, NAME, M]).tolist()) == 0
    # A turn closed by <|im_end|> without <|im_middle|> is ignored; the next valid one still parses.
    ids = [A, NAME, 300, E, A, NAME, M, 301, E]
    assert [ids[i] for i in ones(KIMI_K2.compute(tok, ids).tolist())] == [301]
    # List input.
    assert KIMI_K2.compute(tok, [A, NAME, M, 300, 301, E]).tolist() == [0, 0, 0, 1, 1, 0]
    # A role marker that interrupts the role-name walk is not skipped.
    ids = [A, NAME, A, NAME, M, 7, E]
    assert ones(KIMI_K2.compute(tok, ids).tolist()) == [5]
    # Truncated content runs to the end; last_turn_only keeps the final span.
    assert ones(KIMI_K2.compute(tok, [A, NAME, M, 9, 9]).tolist()) == [3, 4]
    assert ones(KIMI_K2.compute(tok, five_turns, last_turn_only=True).tolist()) == [24]


def test_k2_rendered_conversation_masks_assistant_content():
    tok = synthetic_k2_tokenizer()
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "abc"}]
    ids = render_k2_chat(messages, tok)
    mask = get_loss_mask_recovery(tok).compute(tok, ids).tolist()
    assert tok.decode([ids[i] for i in ones(mask)]) == "abc"
    assert sum(KIMI_K3.compute(synthetic_k3_tokenizer(), ids).tolist()) == 0  # K3 recovery on K2 data: nothing


# ----------------------------------------------------------------------------------------------- golden masks


def test_golden_content_mask_is_the_default(golden_chats, k3_tok):
    for case in golden_chats["cases"]:
        mask = KIMI_K3.compute(k3_tok, case["input_ids"]).tolist()
        assert mask == case["assistant_content_mask"], case["name"]
        assert sum(mask) == case["summary"]["content_mask_sum"]


def test_golden_peer_mask_with_trailer_option(golden_chats, k3_tok):
    """``include_trailer`` adds ``<|close|>message<|sep|>``; ``<|end_of_msg|>`` stays 0 (chat spec §6.7), the one
    token by which the reference's ``{% generation %}`` mask differs."""
    eom = k3_tok.end_of_msg_token_id
    for case in golden_chats["cases"]:
        ids, peer = case["input_ids"], case["assistant_mask_peer"]
        mask = KIMI_K3.compute(k3_tok, ids, include_trailer=True).tolist()
        assert mask == [0 if t == eom else p for t, p in zip(ids, peer)], case["name"]
        n_assistant = sum(1 for i, t in enumerate(ids) if t == eom and peer[i])
        assert sum(peer) - sum(mask) == n_assistant


def test_golden_k2_recovery_would_zero_k3_data(golden_chats):
    """ModelOpt 0.47 picks ``kimi`` on the K2-default-list tokenizer and gets an all-zero mask; we pick kimi_k3."""
    trap = synthetic_k3_tokenizer(added_tokens=K2_DEFAULT_ADDITIONAL_SPECIAL_TOKENS)
    for case in golden_chats["cases"]:
        reference = case["modelopt_0_47"]["tokenizer_additional_special_tokens=None (peer K2-era default list)"]
        assert reference["recovery"] == "kimi" and reference["mask_sum"] == 0
        assert KIMI_K2.compute(trap, case["input_ids"]).sum() == 0
        assert get_loss_mask_recovery(trap).compute(trap, case["input_ids"]).tolist() == case["assistant_content_mask"]


# ----------------------------------------------------------------------------------------------- alignment (25)


def test_25_trainer_supervised_tokens_of_worked_example(k3_words_tok):
    tok = k3_words_tok
    ids = torch.tensor(_worked_example(tok))
    mask = KIMI_K3.compute(tok, ids)
    shifted = torch.cat([ids[1:], ids.new_zeros(1)])  # shift(x)[t] = x[t+1]
    predicted = tok.convert_ids_to_tokens(shifted[mask == 1].tolist())
    assert predicted == ["response", "<|sep|>", "Hello", "<|close|>", "response", "<|sep|>", "<|close|>"]
