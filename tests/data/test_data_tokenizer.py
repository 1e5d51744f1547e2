"""The Kimi tiktoken tokenizer: golden layout, special handling, directory loading, the §1.5 trap."""

from __future__ import annotations

import json
import pickle

import pytest

from lightning_eagle.data import load_kimi_tokenizer, synthetic_k2_tokenizer, synthetic_k3_tokenizer
from lightning_eagle.data.synthetic_tokenizer import byte_ranks
from lightning_eagle.data.tokenizer import K3_PAT_STR, KimiTokenizer
from lightning_eagle.data.tokenizer_files import (
    K2_DEFAULT_ADDITIONAL_SPECIAL_TOKENS,
    extract_pat_str,
    read_tiktoken_model,
    save_tokenizer_dir,
    write_tiktoken_model,
)


def test_synthetic_k3_matches_golden_layout(golden_chats, k3_tok):
    info = golden_chats["tokenizer"]
    assert k3_tok.num_base_tokens == info["base_size"] == 256
    assert k3_tok.vocab_size == len(k3_tok) == info["vocab_size"] == 512
    for name, token_id in info["named_specials"].items():
        assert k3_tok.convert_tokens_to_ids(name) == token_id, name
    bos, eos, pad, unk = info["bos/eos/pad/unk"]
    assert (k3_tok.bos_token_id, k3_tok.eos_token_id, k3_tok.pad_token_id, k3_tok.unk_token_id) == (bos, eos, pad, unk)
    # Every unnamed slot is a reserved placeholder, including offset 65 (the golden layout has no <osagent_mode>).
    named = set(info["named_specials"].values())
    for token_id in range(256, 512):
        if token_id not in named:
            assert k3_tok.convert_ids_to_tokens(token_id) == f"<|reserved_token_{token_id}|>"
    assert k3_tok.end_of_msg_token_id == 258
    assert k3_tok.chat_format == "k3"


def test_byte_ranks_encode_and_decode(k3_tok):
    text = "Héllo, wörld! 123 \n\t 漢字"
    ids = k3_tok.encode(text)
    assert ids == list(text.encode())  # byte vocab without merges: one token per UTF-8 byte
    assert k3_tok.decode(ids) == text
    assert k3_tok.decode(ids[:1]) == "H"


def test_specials_allowed_by_default_and_ordinary_when_disallowed(k3_tok):
    text = "a<|open|>b"
    assert k3_tok.encode(text) == [97, 259, 98]
    literal = k3_tok.encode(text, allow_special_tokens=False)
    assert literal == list(text.encode()) and 259 not in literal
    assert k3_tok.decode(literal) == k3_tok.decode([97, 259, 98]) == text


def test_convert_tokens_to_ids_unknown_is_unk_and_byte_strings_resolve(k3_tok):
    assert k3_tok.convert_tokens_to_ids("<|im_assistant|>") == k3_tok.unk_token_id
    assert k3_tok.convert_tokens_to_ids("a") == 97
    assert k3_tok.convert_tokens_to_ids("Ġ") == 32  # GPT-2 spelling of the space byte
    assert k3_tok.convert_tokens_to_ids(["<|sep|>", "[PAD]"]) == [261, 511]
    assert k3_tok.convert_ids_to_tokens([259, 97]) == ["<|open|>", "a"]


def test_merges_make_multibyte_tokens_and_shift_specials():
    tok = synthetic_k3_tokenizer(merges=["message", "assistant"])
    assert len(tok.encode("message", allow_special_tokens=False)) == 1
    assert len(tok.encode("assistant", allow_special_tokens=False)) == 1
    assert tok.convert_tokens_to_ids("<|open|>") == tok.num_base_tokens + 3
    assert tok.vocab_size == tok.num_base_tokens + 256


def test_k2_layout():
    tok = synthetic_k2_tokenizer()
    assert tok.convert_tokens_to_ids("<|im_end|>") == 258
    assert tok.convert_tokens_to_ids("<|im_assistant|>") == 260
    assert tok.convert_tokens_to_ids("<|im_middle|>") == 273
    assert tok.convert_tokens_to_ids("<|open|>") == tok.unk_token_id
    assert tok.chat_format == "k2" and tok.end_of_msg_token_id is None


def test_long_whitespace_runs_are_split_without_changing_ids(k3_tok):
    text = "x" + " " * 60_000 + "y" * 30_000
    assert k3_tok.encode(text) == list(text.encode())


def test_missing_single_byte_rank_is_rejected_before_tiktoken_panics():
    ranks = byte_ranks()
    del ranks[b"\xff"]
    ranks = {tok: i for i, tok in enumerate(ranks)}
    with pytest.raises(ValueError, match="all 256 single bytes"):
        KimiTokenizer(ranks, {})


def test_directory_round_trip_gives_identical_ids(tmp_path, k3_tok):
    save_tokenizer_dir(k3_tok, tmp_path / "tok")
    loaded = load_kimi_tokenizer(tmp_path / "tok")
    text = 'Hi <|open|>message role="assistant"<|sep|> done'
    assert loaded.encode(text) == k3_tok.encode(text)
    assert loaded.special_tokens == k3_tok.special_tokens
    assert loaded.vocab_size == 512 and loaded.pad_token_id == 511 and loaded.unk_token_id == 510
    assert loaded.fingerprint == k3_tok.fingerprint
    assert loaded.added_tokens == {}  # additional_special_tokens = ["<|end_of_msg|>"] as in the released config


def test_tiktoken_model_format_round_trip(tmp_path):
    ranks = byte_ranks(["ab", "abc"])
    path = write_tiktoken_model(ranks, tmp_path / "tiktoken.model")
    assert read_tiktoken_model(path) == ranks
    path.write_text(path.read_text() + "not-base64!! x\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:259: expected 'base64-token rank'"):
        read_tiktoken_model(path)


def test_changed_vocab_file_at_same_path_is_not_served_stale(tmp_path, k3_tok):
    # tiktoken's load_tiktoken_bpe caches local files by path; our reader must see the new content.
    directory = save_tokenizer_dir(k3_tok, tmp_path / "tok")
    assert load_kimi_tokenizer(directory).encode("a") == [97]
    swapped = byte_ranks()
    swapped[b"a"], swapped[b"b"] = 98, 97
    write_tiktoken_model(swapped, directory / "tiktoken.model")
    assert load_kimi_tokenizer(directory).encode("a") == [98]


def test_missing_additional_special_tokens_reproduces_k2_trap(tmp_path, k3_tok):
    directory = save_tokenizer_dir(k3_tok, tmp_path / "tok", write_additional=False)
    tok = load_kimi_tokenizer(directory)
    ids = [tok.convert_tokens_to_ids(t) for t in K2_DEFAULT_ADDITIONAL_SPECIAL_TOKENS]
    # Names not in the special table become added tokens above the 512 ids, like the released slow tokenizer.
    assert tok.convert_tokens_to_ids("<|im_assistant|>") >= 512
    assert tok.unk_token_id not in ids
    assert tok.convert_tokens_to_ids("[EOT]") == 265  # already a special: not added twice
    assert tok.vocab_size == 512 and len(tok) == 512 + len(tok.added_tokens)
    assert tok.decode([97, tok.convert_tokens_to_ids("<|im_end|>")]) == "a<|im_end|>"


def test_pat_str_is_read_from_tokenization_kimi_without_executing_it(tmp_path, k3_tok):
    directory = save_tokenizer_dir(k3_tok, tmp_path / "tok")
    (directory / "tokenization_kimi.py").write_text(
        "raise SystemExit('must not run')\n"
        "class TikTokenTokenizer:\n"
        '    pat_str = "|".join([r"""\\p{N}{1,3}""", r"""\\s+"""])\n'
    )
    assert extract_pat_str(directory / "tokenization_kimi.py") == r"\p{N}{1,3}|\s+"
    assert load_kimi_tokenizer(directory).pat_str == r"\p{N}{1,3}|\s+"
    (directory / "tokenization_kimi.py").unlink()
    assert load_kimi_tokenizer(directory).pat_str == K3_PAT_STR


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_kimi_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tiktoken.model"):
        load_kimi_tokenizer(tmp_path / "empty")
    (tmp_path / "empty" / "tokenizer_config.json").write_text("{bad")
    with pytest.raises(ValueError, match="tokenizer_config.json: invalid JSON"):
        load_kimi_tokenizer(tmp_path / "empty")


def test_pickle_round_trip(k3_tok):
    clone = pickle.loads(pickle.dumps(k3_tok))
    assert clone.fingerprint == k3_tok.fingerprint
    assert clone.encode("x<|sep|>") == k3_tok.encode("x<|sep|>")


def test_apply_chat_template_uses_reference_defaults(k3_tok):
    messages = [{"role": "user", "content": "Hi"}]
    text = k3_tok.apply_chat_template(messages)
    assert text.startswith('<|open|>message role="system" type="thinking-effort"<|sep|>')
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    ids = k3_tok.apply_chat_template(messages, tokenize=True, truncation=True, max_length=5)
    assert len(ids) == 5


def test_fingerprint_changes_with_layout(k3_tok):
    assert synthetic_k3_tokenizer().fingerprint == k3_tok.fingerprint
    assert synthetic_k2_tokenizer().fingerprint != k3_tok.fingerprint
    assert synthetic_k3_tokenizer(merges=["ab"]).fingerprint != k3_tok.fingerprint
    json.dumps(k3_tok.fingerprint)
