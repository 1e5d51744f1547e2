"""Long rows (8K-20K tokens) through the whole data pipeline at ``max_length`` 16384 and 65536: encode (the right
cut of `chat_and_loss_mask.md` §1.6 / §4.4, the mask recovered on the cut ids), cache round trip (several chunks),
sampling (every row once) and batching (padded per batch); the long-corpus generator; the cut counts the report
reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_eagle.data import ChatDataModule, get_loss_mask_recovery, render_k3_chat, synthetic_k3_tokenizer
from lightning_eagle.data.dataset import TokenizedChatDataset
from lightning_eagle.data.encoding import REPORT_CUT_LENGTHS, cut_lengths
from lightning_eagle.data.long_corpus import generate_long_corpus, rendered_length, write_long_corpus

RENDER = {"thinking": True, "thinking_effort": None}
LONG_PRETOKENIZED = 20_000  # longer than 16384, shorter than 65536


@pytest.fixture(scope="module")
def long_files(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Six chats of 8K-20K rendered tokens and one pre-tokenized row of 20000 tokens with a stored mask."""
    chats = generate_long_corpus(6, seed=3, min_tokens=8192, max_tokens=20_000, **RENDER)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (LONG_PRETOKENIZED,), generator=g).tolist()
    mask = [0] * 100 + [1] * (LONG_PRETOKENIZED - 100)
    rows = [*chats, {"input_ids": ids, "loss_mask": mask}]
    path = tmp_path_factory.mktemp("long_rows") / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def _expected(rows: list[dict], max_length: int) -> list[tuple[list[int], list[int], int]]:
    """(ids, mask, full length) of every row by today's policy, computed here without the pipeline: render whole,
    right-cut, recover the mask on the cut ids (stored masks are cut alike)."""
    tok = synthetic_k3_tokenizer()
    recovery = get_loss_mask_recovery(tok)
    out = []
    for row in rows:
        if "messages" in row:
            full = render_k3_chat(row["messages"], tok, add_generation_prompt=False, **RENDER)
            ids = full[:max_length]
            mask = recovery.compute(tok, ids).tolist()
        else:
            full, ids, mask = row["input_ids"], row["input_ids"][:max_length], row["loss_mask"][:max_length]
        out.append((ids, mask, len(full)))
    return out


@pytest.mark.parametrize("max_length", [16384, 65536])
def test_long_rows_encode_cache_sample_and_batch(long_files, tmp_path, max_length):
    path, rows = long_files
    expected = _expected(rows, max_length)
    full_lengths = [n for _, _, n in expected]
    assert min(full_lengths) >= 8192 and max(full_lengths) <= 20_000
    assert any(n > 16384 for n in full_lengths)  # the 16K run cuts some rows, the 64K run none

    dm = ChatDataModule(train_files=[str(path)], max_length=max_length, batch_size=3, val_fraction=0,
                        cache_dir=str(tmp_path / "cache"), **RENDER)  # fmt: skip
    # several chunks, written one by one and concatenated into the row file, then memory-mapped back
    cached = TokenizedChatDataset.build_or_load([str(path)], dm.tokenizer, dm.recovery, dm._encode_options(),
                                                cache_dir=dm.cache_dir, chunk_rows=2)  # fmt: skip
    memory = TokenizedChatDataset.build_or_load([str(path)], dm.tokenizer, dm.recovery, dm._encode_options(),
                                                cache_dir=None, chunk_rows=3)  # fmt: skip
    reread = TokenizedChatDataset.load(dm.cache_dir / cached.key, cached.key)
    assert reread is not None and reread.from_cache and reread.key == memory.key == cached.key
    for data in (cached, memory, reread):
        assert len(data) == len(rows)
        for i, (ids, mask, _) in enumerate(expected):
            assert data[i]["input_ids"].tolist() == ids and data[i]["loss_mask"].tolist() == mask
        assert data.lengths().tolist() == [min(n, max_length) for n in full_lengths]
        assert data.summary.rows_truncated == sum(n > max_length for n in full_lengths)
        assert data.summary.rendered_tokens == sum(full_lengths)
        for n in cut_lengths(max_length):
            rows_cut, tokens_cut = data.summary.length_cuts[str(n)]
            assert rows_cut == sum(f > n for f in full_lengths)
            assert tokens_cut == sum(max(0, f - n) for f in full_lengths)

    dm.setup("fit")  # reads the cache written above
    assert dm._train_data.from_cache and len(dm.train_dataset) == len(rows)
    seen = []
    for batch in dm.train_dataloader():
        lengths = batch["attention_mask"].sum(1)
        assert batch["input_ids"].shape[1] == int(lengths.max())  # padded to the batch's longest row only
        for b in range(batch["input_ids"].shape[0]):
            n = int(lengths[b])
            match = [
                i
                for i, (ids, _, _) in enumerate(expected)
                if len(ids) == n and batch["input_ids"][b, :n].tolist() == ids
            ]
            assert len(match) == 1
            assert batch["loss_mask"][b, :n].tolist() == expected[match[0]][1]
            assert not batch["loss_mask"][b, n:].any() and not batch["attention_mask"][b, n:].any()
            seen.append(match[0])
    assert sorted(seen) == list(range(len(rows)))  # every row once


def test_long_corpus_generator_lengths_and_determinism(tmp_path):
    tok = synthetic_k3_tokenizer()
    rows = generate_long_corpus(4, seed=1, min_tokens=8192, max_tokens=16384)
    lengths = [len(render_k3_chat(r["messages"], tok, add_generation_prompt=False, **RENDER)) for r in rows]
    assert all(8192 <= n <= 16384 for n in lengths), lengths
    assert lengths == [rendered_length(r["messages"], tok, **RENDER) for r in rows]
    assert len(set(lengths)) == len(lengths)  # mixed lengths, for bucketing tests
    assert generate_long_corpus(4, seed=1) == rows and generate_long_corpus(4, seed=2) != rows
    path = write_long_corpus(tmp_path / "sub" / "long.jsonl", 4, seed=1)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    # the length depends on the render options: the generator measures with the ones it is given
    effort = generate_long_corpus(1, seed=1, thinking_effort="max")[0]["messages"]
    assert 8192 <= len(render_k3_chat(effort, tok, add_generation_prompt=False, thinking=True)) <= 16384
    with pytest.raises(ValueError, match="max_tokens >= min_tokens"):
        generate_long_corpus(1, min_tokens=8192, max_tokens=8200)


def test_max_length_settings():
    assert cut_lengths(4096) == REPORT_CUT_LENGTHS and cut_lengths(100_000)[-1] == 100_000
    assert cut_lengths(12_000) == tuple(sorted((*REPORT_CUT_LENGTHS, 12_000)))
    with pytest.raises(ValueError, match="data.max_length must be an integer"):
        ChatDataModule(max_length=4096.5)
    with pytest.raises(ValueError, match="data.max_length must be at least 2"):
        ChatDataModule(max_length=1)


def test_held_out_prompts_can_be_capped_below_max_length(tmp_path, jsonl_writer):
    from lightning_eagle.data.prompts import prompts_from_datamodule

    def chat(n: int) -> dict:
        return {"messages": [{"role": "user", "content": "w" * n}, {"role": "assistant", "content": "ok"}]}

    val = jsonl_writer("val.jsonl", [chat(50), chat(900), chat(3000)])
    dm = ChatDataModule(val_files=[str(val)], max_length=65536, cache_dir=str(tmp_path), **RENDER)
    every = prompts_from_datamodule(dm)  # default: prompts up to max_length
    assert len(every) == 3
    cap = sorted(len(p) for p in every)[1]
    assert prompts_from_datamodule(dm, max_prompt_tokens=cap) == [p for p in every if len(p) <= cap]
    assert len(prompts_from_datamodule(dm, max_prompt_tokens=cap)) == 2
