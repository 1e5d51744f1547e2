"""Tokenization pipeline: truncation/drop accounting, pre-tokenized rows, worker processes, on-disk cache."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_eagle.data import encoding, render_k3_chat, synthetic_k3_tokenizer
from lightning_eagle.data.dataset import TokenizedChatDataset, collate_chat_rows
from lightning_eagle.data.encoding import EncodeOptions
from lightning_eagle.data.loss_mask import KIMI_K3

CHAT = {"messages": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}]}
NO_ASSISTANT = {"messages": [{"role": "user", "content": "nobody answers"}]}


def options(**overrides) -> EncodeOptions:
    base = dict(
        max_length=4096,
        render_options={"thinking": True, "thinking_effort": None},
        recovery_name="kimi_k3",
        recovery_options=dict(KIMI_K3.defaults),
        on_bad_row="raise",
    )
    base.update(overrides)
    return EncodeOptions(**base)


def build(files, tok, cache_dir=None, workers=0, **overrides):
    return TokenizedChatDataset.build_or_load(
        files, tok, KIMI_K3, options(**overrides), cache_dir=cache_dir, workers=workers
    )


def test_rows_match_render_and_recovery(jsonl_writer, k3_tok):
    data = build([jsonl_writer("a.jsonl", [CHAT])], k3_tok)
    item = data[0]
    expected = render_k3_chat(CHAT["messages"], k3_tok, thinking_effort=None)
    assert item["input_ids"].tolist() == expected
    assert torch.equal(item["loss_mask"], KIMI_K3.compute(k3_tok, expected))
    assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.long


def test_pipeline_never_adds_a_generation_prompt(jsonl_writer, k3_tok, monkeypatch):
    seen = []
    real = encoding.build_k3_segments

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(encoding, "build_k3_segments", spy)
    opts = {"thinking": False, "thinking_effort": None, "add_generation_prompt": True}
    data = build([jsonl_writer("a.jsonl", [CHAT])], k3_tok, render_options=opts)
    assert seen and all(kw["add_generation_prompt"] is False and kw["thinking"] is False for kw in seen)
    assert k3_tok.decode(data[0]["input_ids"][-1:]) == "<|end_of_msg|>"


def test_truncation_and_unsupervised_rows_are_counted(jsonl_writer, k3_tok):
    path = jsonl_writer("a.jsonl", [CHAT, NO_ASSISTANT, CHAT])
    full = len(render_k3_chat(CHAT["messages"], k3_tok, thinking_effort=None))
    user_part = len(render_k3_chat(CHAT["messages"][:1], k3_tok, thinking_effort=None))
    data = build([path], k3_tok, max_length=full - 3)
    assert data.summary.rows_truncated == 2 and data.summary.rows_without_supervision == 1
    assert data.summary.rows_kept == len(data) == 2
    assert all(len(data[i]["input_ids"]) == full - 3 for i in range(2))
    # Cutting away every assistant token drops the row (mask all zero) and counts it.
    cut = build([path], k3_tok, max_length=user_part + 3)
    assert len(cut) == 0 and cut.summary.rows_without_supervision == 3 and cut.summary.rows_truncated == 2
    assert (
        "3 dropped with nothing to predict (no supervised token after the first), 2 truncated" in cut.summary.describe()
    )


def test_pretokenized_rows_use_stored_mask_or_recovery(jsonl_writer, k3_tok):
    ids = render_k3_chat(CHAT["messages"], k3_tok, thinking_effort=None)
    stored = [0] * (len(ids) - 1) + [1]
    path = jsonl_writer("tok.jsonl", [{"input_ids": ids, "loss_mask": stored}, {"input_ids": ids}])
    data = build([path], k3_tok, max_length=len(ids))
    assert data[0]["loss_mask"].tolist() == stored
    assert torch.equal(data[1]["loss_mask"], KIMI_K3.compute(k3_tok, ids))
    cut = build([path], k3_tok, max_length=len(ids) - 1)  # stored mask cut too: its only 1 is gone -> dropped
    assert len(cut) == 1 and cut.summary.rows_without_supervision == 1


def test_worker_processes_give_identical_rows_and_report_bad_rows(tmp_path, k3_tok):
    from lightning_eagle.data import generate_synthetic_corpus

    rows = generate_synthetic_corpus(40, seed=3)
    rows.insert(17, {"messages": [{"role": "robot", "content": "x"}]})
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    in_process = build([path], k3_tok, workers=0, on_bad_row="skip")
    with_workers = build([path], k3_tok, workers=2, on_bad_row="skip")  # spawned processes
    assert len(with_workers) == 40
    assert torch.equal(in_process.input_ids, with_workers.input_ids)
    assert torch.equal(in_process.loss_mask, with_workers.loss_mask)
    assert torch.equal(in_process.offsets, with_workers.offsets)
    assert with_workers.summary.bad_row_examples == [
        f"{path}:18: messages[0].role: expected one of ['system', 'user', 'assistant', 'tool'], got str \"robot\""
    ]


def test_cache_hit_and_invalidation(tmp_path, jsonl_writer, k3_tok, monkeypatch):
    path = jsonl_writer("a.jsonl", [CHAT, CHAT])
    cache = tmp_path / "cache"
    first = build([path], k3_tok, cache_dir=cache)
    assert not first.from_cache and (cache / first.key / "data.safetensors").is_file()
    manifest = json.loads((cache / first.key / "manifest.json").read_text())
    assert manifest["summary"]["rows_kept"] == 2 and manifest["key"] == first.key
    assert not list(cache.rglob("*.pkl")) and not list(cache.rglob("*.pt"))

    # Same inputs: loaded without tokenizing (tokenizing now would fail loudly).
    monkeypatch.setattr(TokenizedChatDataset, "build", classmethod(lambda *a, **k: pytest.fail("re-tokenized")))
    again = build([path], k3_tok, cache_dir=cache)
    assert again.from_cache and again.key == first.key
    assert torch.equal(again.input_ids, first.input_ids) and again.summary.rows_kept == 2
    monkeypatch.undo()

    keys = {first.key}
    changed = [
        build([path], k3_tok, cache_dir=cache, render_options={"thinking": False, "thinking_effort": None}),
        build([path], k3_tok, cache_dir=cache, max_length=50),
        build([path], k3_tok, cache_dir=cache, recovery_options={**KIMI_K3.defaults, "include_trailer": True}),
        build([path], k3_tok, cache_dir=cache, on_bad_row="skip"),
        build([path], synthetic_k3_tokenizer(merges=["ab"]), cache),
    ]
    for data in changed:
        assert not data.from_cache and data.key not in keys
        keys.add(data.key)
    assert not torch.equal(changed[0].input_ids, first.input_ids)
    assert not torch.equal(changed[2].loss_mask, first.loss_mask)

    # Changing the file content invalidates too.
    jsonl_writer("a.jsonl", [CHAT])
    edited = build([path], k3_tok, cache_dir=cache)
    assert not edited.from_cache and edited.key not in keys and len(edited) == 1


def test_corrupt_cache_is_rebuilt(tmp_path, jsonl_writer, k3_tok):
    path = jsonl_writer("a.jsonl", [CHAT])
    cache = tmp_path / "cache"
    first = build([path], k3_tok, cache_dir=cache)
    (cache / first.key / "data.safetensors").write_bytes(b"garbage")
    again = build([path], k3_tok, cache_dir=cache)
    assert not again.from_cache and torch.equal(again.input_ids, first.input_ids)
    assert build([path], k3_tok, cache_dir=cache).from_cache


def test_a_damaged_cache_that_still_parses_is_rebuilt(tmp_path, jsonl_writer, k3_tok):
    """Issue 30: one flipped byte in the token data keeps the file readable; the manifest's checksum refuses it."""
    path = jsonl_writer("a.jsonl", [CHAT, CHAT])
    cache = tmp_path / "cache"
    first = build([path], k3_tok, cache_dir=cache)
    data = cache / first.key / "data.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01  # the last loss-mask byte
    data.write_bytes(bytes(raw))
    again = build([path], k3_tok, cache_dir=cache)
    assert not again.from_cache and torch.equal(again.loss_mask, first.loss_mask)
    assert build([path], k3_tok, cache_dir=cache).from_cache


def test_missing_file(tmp_path, k3_tok):
    with pytest.raises(FileNotFoundError, match="not found"):
        build([tmp_path / "missing.jsonl"], k3_tok)


def test_collate_right_pads():
    rows = [
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1])},
        {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([0])},
    ]
    batch = collate_chat_rows(rows, pad_token_id=511)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 511, 511]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 0, 0]]
    assert collate_chat_rows(rows, 511, pad_to=5)["input_ids"].shape == (2, 5)
    with pytest.raises(ValueError, match="exceeds pad_to"):
        collate_chat_rows(rows, 511, pad_to=2)
    with pytest.raises(RuntimeError, match="no supervised token"):
        collate_chat_rows(rows[1:], 511)
