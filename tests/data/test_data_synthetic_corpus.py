"""The bundled synthetic corpus: reproducible byte for byte, valid, learnable patterns, sensible lengths."""

from __future__ import annotations

import json
import re

from lightning_eagle.data import bundled_sample_path, generate_synthetic_corpus, render_k3_chat
from lightning_eagle.data.loss_mask import KIMI_K3
from lightning_eagle.data.rows import validate_row
from lightning_eagle.data.synthetic_corpus import SAMPLE_SEED, SAMPLE_SIZE, corpus_to_jsonl


def test_bundled_file_is_reproduced_exactly():
    path = bundled_sample_path()
    assert path.read_text(encoding="utf-8") == corpus_to_jsonl(generate_synthetic_corpus(SAMPLE_SIZE, SAMPLE_SEED))
    assert path.stat().st_size < 300_000


def test_generator_is_deterministic_and_seeded():
    assert generate_synthetic_corpus(20, 5) == generate_synthetic_corpus(20, 5)
    assert generate_synthetic_corpus(20, 5) != generate_synthetic_corpus(20, 6)
    assert generate_synthetic_corpus(10, 5) == generate_synthetic_corpus(20, 5)[:10]


def test_rows_are_valid_and_cover_every_feature(k3_tok):
    rows = [json.loads(line) for line in bundled_sample_path().read_text().splitlines()]
    assert len(rows) == SAMPLE_SIZE
    for row in rows:
        assert validate_row(row, 512) == "chat"
    messages = [m for r in rows for m in r["messages"]]
    assert any(m.get("tool_calls") for m in messages) and any(m["role"] == "tool" for m in messages)
    assert any(m["role"] == "system" for m in messages) and any(m.get("reasoning_content") for m in messages)
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) >= 2 for r in rows)  # multi-turn
    assert any(isinstance(c["function"]["arguments"], dict) for m in messages for c in m.get("tool_calls", []))
    assert any(isinstance(c["function"]["arguments"], str) for m in messages for c in m.get("tool_calls", []))


def test_answers_follow_from_questions():
    for row in generate_synthetic_corpus(200, 11):
        msgs = row["messages"]
        for question, answer in zip(msgs, msgs[1:]):
            if question["role"] != "user" or answer["role"] != "assistant":
                continue
            match = re.fullmatch(r"What is (\d+) (plus|minus|times) (\d+)\?", question["content"])
            if match:
                a, op, b = int(match[1]), match[2], int(match[3])
                result = {"plus": a + b, "minus": a - b, "times": a * b}[op]
                assert answer["content"].endswith(f"= {result}.")
            match = re.fullmatch(r"Spell (\w+) backwards\.", question["content"])
            if match:
                assert answer["content"] == f"{match[1]} backwards is {match[1][::-1]}."


def test_lengths_with_the_byte_tokenizer(k3_tok):
    rows = generate_synthetic_corpus(100, 0)
    lengths = sorted(len(render_k3_chat(r["messages"], k3_tok, thinking_effort=None)) for r in rows)
    assert 100 <= lengths[0] and lengths[len(lengths) // 2] <= 300 and lengths[-1] <= 1024
    for row in rows[:20]:
        ids = render_k3_chat(row["messages"], k3_tok)
        assert KIMI_K3.compute(k3_tok, ids).sum() > 0
