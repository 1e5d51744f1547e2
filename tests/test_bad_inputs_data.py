"""Bad chat data that used to pass silently (issue 39, "Nothing silent", parts 6 and 7): the shared tokenized-data cache
under concurrent builders, truncated and multi-frame ``.zst`` shards, CR line ends, and lines too long to tokenize
whole. Refusals follow the table style of ``tests/test_bad_inputs.py``: one clear error raised by this library, its
message's fragments in order, nothing written."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import subprocess
import sys
import time
import tracemalloc

import pytest
import zstandard
from bad_input_helpers import GOOD, assert_raised_by_library, expect, snapshot
from eagle_helpers import data_kwargs

from lightning_eagle.data import ChatDataModule, DataRowError, synthetic_k3_tokenizer
from lightning_eagle.data import dataset as dataset_module
from lightning_eagle.data.cache_files import CHUNKS_DIR, MANIFEST_FILE, ChunkLostError
from lightning_eagle.data.cache_lock import LOCK_FILE
from lightning_eagle.data.dataset import TokenizedChatDataset
from lightning_eagle.data.encoding import ENCODE_WINDOW_CHARS, EncodeOptions, RowEncoder, RowJob
from lightning_eagle.data.formats import iter_items, iter_rows
from lightning_eagle.data.loss_mask import KIMI_K3
from lightning_eagle.data.rows import RawRow
from lightning_eagle.errors import OutputWriteError

ROWS = ("".join(json.dumps({**GOOD, "n": i}) + "\n" for i in range(40))).encode()
ZSTD = zstandard.ZstdCompressor()


def options(max_length: int = 160) -> EncodeOptions:
    return EncodeOptions(
        max_length=max_length,
        render_options={"thinking": True, "thinking_effort": None},
        recovery_name="kimi_k3",
        recovery_options=dict(KIMI_K3.defaults),
    )


# ---- files read silently as fewer rows, or as one row: ChatDataModule(train_files=...).setup() ---------------------
READER_CASES = [
    pytest.param(
        "rows.jsonl.zst", ZSTD.compress(ROWS)[:-12], DataRowError,
        ["$file:1: <file>: cannot read the compressed file (EOFError: the file ends inside a zstd frame (truncated"],
        id="truncated-zst",
    ),
    pytest.param(
        "rows.jsonl.zst", ZSTD.compress(ROWS[:2000]) + ZSTD.compress(ROWS[2000:])[:-12], DataRowError,
        ["$file:17: <file>: cannot read the compressed file (EOFError: the file ends inside a zstd frame"],
        id="truncated-last-frame-of-a-multi-frame-zst",
    ),
    pytest.param(  # how a truncated .gz was always reported
        "rows.jsonl.gz", gzip.compress(ROWS)[:-12], DataRowError,
        ["$file:", "<file>: cannot read the compressed file (EOFError: Compressed file ended"],
        id="truncated-gz",
    ),
    pytest.param(
        "rows.jsonl", ROWS.replace(b"\n", b"\r"), DataRowError,
        ["$file:1: <file>: the file uses CR (old Mac) line ends: JSONL rows end in LF", "convert the line ends"],
        id="cr-line-ends",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "exc", "fragments"), READER_CASES)
def test_unreadable_chat_file(tmp_path, name, content, exc, fragments):
    path = tmp_path / name
    path.write_bytes(content)
    before = snapshot(tmp_path)
    for skip in ("raise", "skip"):  # a file that cannot be read is refused whatever on_bad_row says
        data = ChatDataModule(**data_kwargs(train_files=[str(path)], on_bad_row=skip))
        with expect(exc, fragments, file=path) as info:
            data.setup("fit")
        assert_raised_by_library(info)
    assert snapshot(tmp_path) == before


def test_multi_frame_zst_reads_every_frame(tmp_path):
    rows = [json.dumps({**GOOD, "n": i, "pad": "x" * (i % 97)}).encode() + b"\n" for i in range(800)]
    frames, start = [], 0
    for size in (1, 7, 60, 3, 200, 29, 500):  # frames of uneven sizes, boundaries anywhere in a line
        end = min(len(rows), start + size) if size != 500 else len(rows)
        frames.append(ZSTD.compress(b"".join(rows[start:end])))
        start = end
    skippable = b"\x50\x2a\x4d\x18" + (3).to_bytes(4, "little") + b"abc"  # zstd's skippable frame: no rows
    path = tmp_path / "rows.jsonl.zst"
    path.write_bytes(frames[0] + skippable + b"".join(frames[1:]))
    got = [row.data["n"] for row in iter_rows(path)]
    assert got == list(range(800))


def test_crlf_and_a_byte_order_mark_still_read(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + ROWS.replace(b"\n", b"\r\n") + b"  \r\n")
    assert [row.data["n"] for row in iter_rows(path)] == list(range(40))


# ---- a line too long to tokenize whole ------------------------------------------------------------------------------
def test_a_long_row_is_cut_before_tokenizing_to_the_same_first_tokens():
    tok = synthetic_k3_tokenizer(merges=["hello", " world"])
    encoder = RowEncoder(tok, KIMI_K3, options(max_length=300))
    long = ("hello world é 漢字 " * 60_000)[: 2 * ENCODE_WINDOW_CHARS + 123]  # three windows, multi-byte characters
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long}]},
        {"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": long}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "short answer"}]},  # fits
    ]
    for row in rows:
        whole = tok.encode_segments(encoder._segments(row))  # uncut
        status, ids, mask, full_length = encoder(RowJob("openai", RawRow("f", 1, row)))
        assert status == "ok"
        assert list(ids) == whole[:300]
        assert len(mask) == len(ids)
        if len(whole) <= 300:
            assert full_length == len(whole)
        else:  # encoded only as far as the budget (one window past it at most): a lower bound, still > every cut
            assert encoder.token_budget <= full_length <= len(whole)


def test_a_very_long_line_is_read_and_tokenized_in_bounded_memory(tmp_path, monkeypatch):
    tok = synthetic_k3_tokenizer()
    text = "abc de " * (24_000_000 // 7)  # one 24 MB JSONL line; the byte tokenizer: one token per byte
    path = tmp_path / "long.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]})
    )
    line_bytes = path.stat().st_size
    del text

    tracemalloc.start()
    try:
        items = list(iter_items(path))
        read_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(items) == 1 and len(items[0].text) == line_bytes
    assert read_peak < 2.5 * line_bytes, f"reading one {line_bytes}-byte line peaked at {read_peak} bytes"
    del items

    encoded_chars = []
    real = type(tok).encode

    def counting(self, text, allow_special_tokens=True):
        encoded_chars.append(len(text))
        return real(self, text, allow_special_tokens=allow_special_tokens)

    monkeypatch.setattr(type(tok), "encode", counting)
    tracemalloc.start()
    started = time.monotonic()
    try:
        data = TokenizedChatDataset.build_or_load([path], tok, KIMI_K3, options(160), cache_dir=None, workers=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(data) == 1 and len(data[0]["input_ids"]) == 160 and data.summary.rows_truncated == 1
    assert max(encoded_chars) <= ENCODE_WINDOW_CHARS and sum(encoded_chars) < 2 * ENCODE_WINDOW_CHARS
    assert peak < 4 * line_bytes, f"tokenizing one {line_bytes}-byte line peaked at {peak} bytes"
    assert time.monotonic() - started < 60


# ---- the shared cache: two builders of one key -----------------------------------------------------------------------
BUILDER = """
import hashlib, json, os, sys, time
from pathlib import Path
from lightning_eagle.data import synthetic_k3_tokenizer
from lightning_eagle.data.dataset import TokenizedChatDataset
from lightning_eagle.data.encoding import EncodeOptions
from lightning_eagle.data.loss_mask import KIMI_K3
rows, cache, ready, go = sys.argv[1:5]
opts = EncodeOptions(max_length=160, render_options={"thinking": True, "thinking_effort": None},
                     recovery_name="kimi_k3", recovery_options=dict(KIMI_K3.defaults))
tok = synthetic_k3_tokenizer()
Path(ready).touch()
while not os.path.exists(go):
    time.sleep(0.005)
data = TokenizedChatDataset.build_or_load([rows], tok, KIMI_K3, opts, cache_dir=cache, workers=0, chunk_rows=8)
digest = hashlib.sha256(data.input_ids.numpy().tobytes() + data.loss_mask.numpy().tobytes()).hexdigest()
print(json.dumps({"from_cache": data.from_cache, "rows": len(data), "digest": digest, "key": data.key}))
"""


def test_two_builders_of_one_key_build_it_once(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**GOOD, "n": i, "pad": "y" * (i % 50)}) + "\n" for i in range(300)))
    cache, go = tmp_path / "cache", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(rows), str(cache), str(tmp_path / f"ready{i}"), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):  # both imported: start them together
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["from_cache"] for r in results) == [False, True]  # one built and committed, one read its cache
    assert results[0]["rows"] == results[1]["rows"] == 300
    assert results[0]["digest"] == results[1]["digest"]
    folder = cache / results[0]["key"]
    assert (folder / MANIFEST_FILE).is_file()
    assert not (folder / CHUNKS_DIR).exists() and not (folder / LOCK_FILE).exists()
    tok = synthetic_k3_tokenizer()
    assert TokenizedChatDataset.load(folder, results[0]["key"]) is not None
    again = TokenizedChatDataset.build_or_load([rows], tok, KIMI_K3, options(), cache_dir=cache, workers=0)
    assert again.from_cache


def test_a_chunk_deleted_mid_build_says_a_rerun_recovers(tmp_path, monkeypatch, caplog):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**GOOD, "n": i}) + "\n" for i in range(6)))
    tok, cache = synthetic_k3_tokenizer(), tmp_path / "cache"
    real = dataset_module.write_rows_file
    lost = []

    def delete_one_first(path, parts, rows_, tokens):
        chunk = next(path.parent.glob(f"{CHUNKS_DIR}/chunk_000001.*"))
        chunk.unlink()
        lost.append(chunk)
        return real(path, parts, rows_, tokens)

    def build():
        return TokenizedChatDataset.build_or_load(
            [rows], tok, KIMI_K3, options(), cache_dir=cache, workers=0, chunk_rows=2
        )

    monkeypatch.setattr(dataset_module, "write_rows_file", delete_one_first)
    with expect(
        ChunkLostError,
        [
            "chat-data chunk $cache/",
            "/chunks/chunk_000001.safetensors was deleted or damaged while the cache was being built",
            "nothing was committed: rerun to recover (the chunks still there are reused, this one is tokenized again)",
        ],
        cache=cache,
    ) as info:
        build()
    assert_raised_by_library(info)
    assert str(lost[0]) in str(info.value)
    folder = lost[0].parent.parent
    assert not (folder / MANIFEST_FILE).exists() and not (folder / LOCK_FILE).exists()

    monkeypatch.setattr(dataset_module, "write_rows_file", real)
    with caplog.at_level(logging.INFO, logger="lightning_eagle.data.dataset"):
        data = build()
    assert "reused 2 tokenized chunk(s)" in caplog.text
    fresh = TokenizedChatDataset.build_or_load([rows], tok, KIMI_K3, options(), cache_dir=None, workers=0)
    assert (
        hashlib.sha256(data.input_ids.numpy().tobytes()).digest()
        == hashlib.sha256(fresh.input_ids.numpy().tobytes()).digest()
    )


def test_a_cache_folder_that_cannot_be_made_is_one_clear_error(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(ROWS)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    before = snapshot(tmp_path)
    with expect(OutputWriteError, ["cannot build the tokenized-data cache in $cache/", "choose a writable "
                                   "data.cache_dir (or set data.use_cache false)"], cache=blocker) as info:  # fmt: skip
        TokenizedChatDataset.build_or_load([rows], synthetic_k3_tokenizer(), KIMI_K3, options(), cache_dir=blocker)
    assert_raised_by_library(info)
    assert snapshot(tmp_path) == before
