"""``resolve_prompts(..., max_prompt_tokens)``: a prompt cap filters while the source is read, for every form of
held-out data (chat file, chats, token-id prompts, pre-tokenized rows, a ``ChatDataModule``, the bundled corpus), so
the first ``num_prompts`` prompts that fit come back even when earlier ones were too long."""

from __future__ import annotations

import json

import pytest

from lightning_eagle import ChatDataModule
from lightning_eagle.data.prompts import resolve_prompts
from lightning_eagle.data.synthetic_corpus import corpus_to_jsonl, generate_synthetic_corpus
from lightning_eagle.data.tokenizer_choice import resolve_tokenizer

OPTIONS = {"thinking": True, "thinking_effort": None}


def _check(data, cap: int, n: int = 3) -> None:
    everything = resolve_prompts(data, "synthetic", None, OPTIONS)
    fitting = [p for p in everything if len(p) <= cap]
    assert len(fitting) >= n and len(fitting) < len(everything)  # the cap drops some, enough remain
    first_n = everything[:n]
    assert any(len(p) > cap for p in first_n)  # capping after reading n prompts would return fewer than n
    assert resolve_prompts(data, "synthetic", n, OPTIONS, max_prompt_tokens=cap) == fitting[:n]
    assert resolve_prompts(data, "synthetic", None, OPTIONS, max_prompt_tokens=cap) == fitting


def _chats() -> list[dict]:
    """Chats whose first prompt is long (a long system message), the later ones short."""
    rows = generate_synthetic_corpus(12, seed=3)
    rows[0] = {**rows[0], "messages": [{"role": "system", "content": "x " * 300}, *rows[0]["messages"]]}
    return rows


def test_cap_filters_while_reading_chats_and_chat_files(tmp_path):
    chats = _chats()
    _check(chats, cap=200)
    path = tmp_path / "chats.jsonl"
    path.write_text(corpus_to_jsonl(chats))
    _check(str(path), cap=200)


def test_cap_filters_token_id_prompts_and_pre_tokenized_rows(tmp_path):
    _check([[1] * 50, [2] * 5, [3] * 60, [4] * 6, [5] * 7, [6] * 8], cap=10)
    rows = [
        {"input_ids": list(range(40)), "loss_mask": [0] * 30 + [1] * 10},  # prompt of 30 tokens
        {"input_ids": list(range(40)), "loss_mask": [0] * 5 + [1] * 5 + [0] * 20 + [1] * 10},  # 5, then 30
        {"input_ids": list(range(20)), "loss_mask": [0] * 8 + [1] * 4 + [0] * 2 + [1] * 6},  # 8, then 14
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _check(str(path), cap=16)


def test_cap_of_a_datamodule_replaces_its_max_length(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(corpus_to_jsonl(_chats() * 4))
    data = ChatDataModule(train_files=[str(path)], max_length=1024, val_fraction=0.5, thinking_effort=None,
                          draft_vocab_size=320, use_cache=False, seed=0)  # fmt: skip
    prompts = resolve_prompts(data, None, None, OPTIONS)
    assert prompts and max(len(p) for p in prompts) <= 1024  # no cap: the data module's max_length
    cap = sorted(len(p) for p in prompts)[len(prompts) // 2]
    capped = resolve_prompts(data, None, 2, OPTIONS, max_prompt_tokens=cap)
    assert capped == [p for p in prompts if len(p) <= cap][:2]
    bundled = resolve_prompts(None, None, None, OPTIONS)  # the bundled corpus's held-out chats
    assert len(bundled[0]) > 80  # its first prompt does not fit the cap below
    assert resolve_prompts(None, None, 2, OPTIONS, max_prompt_tokens=80) == [p for p in bundled if len(p) <= 80][:2]


@pytest.mark.parametrize("cap", [0, 10**9])
def test_extreme_caps(cap):
    chats = _chats()
    got = resolve_prompts(chats, resolve_tokenizer("synthetic"), 4, OPTIONS, max_prompt_tokens=cap)
    assert got == ([] if cap == 0 else resolve_prompts(chats, "synthetic", 4, OPTIONS))
