"""Tokenized chat rows as a dataset, cached on disk as safetensors + a JSON manifest (never pickle).

:meth:`TokenizedChatDataset.build` streams the files through :mod:`lightning_eagle.data.encoding` chunk by chunk.
Without a cache the chunks are held in memory; with one each finished chunk is written to ``<cache>/<key>/chunks/``
at once (atomically), so a killed run resumes with its completed chunks. At the end the chunks are concatenated, one
tensor at a time, into ``data.safetensors`` (:mod:`lightning_eagle.data.cache_files`), ``manifest.json`` is written
last (the commit point) and the chunks are removed. One process builds a key at a time (an exclusive lock,
:mod:`lightning_eagle.data.cache_lock`); another waits and reads what it committed. Reading the cache memory-maps
``data.safetensors``: a dataset is not loaded into RAM, pages are read when rows are.

The cache key hashes the file contents, each file's format, the tokenizer fingerprint and every option that changes
ids or masks. :func:`collate_chat_rows` right-pads rows into a batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lightning_eagle.atomic import atomic_file
from lightning_eagle.data.cache_files import (
    CACHE_FORMAT,
    CHUNKS_DIR,
    DATA_FILE,
    MANIFEST_FILE,
    ChunkStore,
    map_safetensors,
    write_rows_file,
)
from lightning_eagle.data.cache_lock import cache_build_lock
from lightning_eagle.data.encoding import (
    DEFAULT_CHUNK_ROWS,
    ChunkEncoding,
    DataSummary,
    EncodedChunk,
    EncodeOptions,
    RowEncoder,
    cut_lengths,
    read_chunks,
)
from lightning_eagle.data.formats import Source, resolve_sources
from lightning_eagle.data.loss_mask import LossMaskRecovery
from lightning_eagle.data.rows import DataRowError

log = logging.getLogger(__name__)

# Caches at least this big are memory-mapped; smaller ones are read into memory (nothing to gain from a mapping, and
# a row file replaced or truncated under a running process cannot take a mapped dataset with it).
MMAP_MIN_BYTES = 64 << 20

__all__ = [
    "CACHE_FORMAT",
    "DEFAULT_CHUNK_ROWS",
    "MMAP_MIN_BYTES",
    "DataSummary",
    "EncodeOptions",
    "TokenizedChatDataset",
    "cache_key",
    "collate_chat_rows",
    "file_sha256",
]


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_key(
    file_hashes: Sequence[str],
    tokenizer_fingerprint: str,
    options: EncodeOptions,
    formats: Sequence[str] | None = None,
) -> str:
    """``file_hashes``: sha256 of each input file's bytes (as stored: compressed files hash compressed);
    ``formats``: the format each file is read in."""
    payload = {
        "format": CACHE_FORMAT,
        "files": list(file_hashes),
        "tokenizer": tokenizer_fingerprint,
        "options": options.key_fields(),
    }
    if formats is not None:
        payload["file_formats"] = list(formats)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


# --------------------------------------------------------------------------------------------- the dataset


class TokenizedChatDataset(torch.utils.data.Dataset):
    """Variable-length tokenized rows: ``input_ids`` and ``loss_mask`` LongTensors per item.

    Stored flat (``input_ids`` int32, ``loss_mask`` uint8, ``offsets`` int64 [N+1]) plus the source file index and
    line (Parquet: row) of every row, so any row can be traced back to its input. Loaded from the cache, the tensors
    are memory-mapped (caches of at least ``MMAP_MIN_BYTES``; smaller ones are read).
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        offsets: torch.Tensor,
        source_file: torch.Tensor,
        source_line: torch.Tensor,
        summary: DataSummary,
        key: str = "",
        from_cache: bool = False,
    ) -> None:
        self.input_ids, self.loss_mask, self.offsets = input_ids, loss_mask, offsets
        self.source_file, self.source_line = source_file, source_line
        self.summary, self.key, self.from_cache = summary, key, from_cache

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return {"input_ids": self.input_ids[start:end].long(), "loss_mask": self.loss_mask[start:end].long()}

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def source(self, index: int) -> tuple[str, int]:
        """(file, 1-based line; the row number for Parquet) the row came from."""
        return self.summary.files[int(self.source_file[index])], int(self.source_line[index])

    def rows(self, indices: Iterable[int] | None = None) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(len(self)) if indices is None else indices:
            item = self[int(i)]
            yield item["input_ids"], item["loss_mask"]

    # ------------------------------------------------------------------------------------------- building

    @classmethod
    def build(
        cls,
        files: Sequence[str | Path],
        tokenizer: Any,
        recovery: LossMaskRecovery,
        options: EncodeOptions,
        *,
        workers: int | None = None,
        sources: Sequence[Source] | None = None,
        cache_to: str | Path | None = None,
        key: str = "",
        key_fields: dict[str, Any] | None = None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> TokenizedChatDataset:
        """Read, validate, tokenize and mask every row of ``files`` (files, globs, directories; in order).

        Without ``cache_to`` the result is held in memory (the input is still streamed chunk by chunk). With it, the
        chunks go to ``cache_to/chunks/`` (reused when a killed run is repeated), then ``data.safetensors`` and
        ``manifest.json`` are written and the result is the memory-mapped cache (a caller that may race another
        builder of ``cache_to`` holds :func:`~lightning_eagle.data.cache_lock.cache_build_lock`, as
        :meth:`build_or_load` does)."""
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        if sources is None:
            sources = resolve_sources(files, options.format)
        summary = DataSummary(files=[s.path for s in sources], formats=[s.format for s in sources])
        file_index = {name: i for i, name in enumerate(summary.files)}
        store = ChunkStore(Path(cache_to) / CHUNKS_DIR, key, chunk_rows) if cache_to is not None else None
        parts: list[dict[str, torch.Tensor]] = []
        encoding = ChunkEncoding(RowEncoder(tokenizer, recovery, options), workers)
        reusable = store.reusable if store is not None else None
        reused = 0
        try:
            for index, items, results in encoding.run(read_chunks(sources, chunk_rows), reusable):
                if items is None:
                    assert store is not None
                    summary.add_counts(store.summaries[index])
                    reused += 1
                    continue
                part = EncodedChunk(file_index, cut_lengths(options.max_length))
                part.consume(items, results, options.on_bad_row)
                summary.add_counts(part.summary)
                if store is not None:
                    store.save(index, part.tensors(), part.summary)
                else:
                    parts.append(part.tensors())
        except DataRowError:
            if store is not None:  # the input must change to go on, and with it the key: these chunks are orphans
                store.remove()
            raise
        finally:
            encoding.close()
        if reused:
            log.info("chat data: reused %d tokenized chunk(s) of an interrupted run", reused)
        if store is None:
            return cls(*_concatenate(parts), summary, key)
        target = Path(cache_to)
        n_chunks = len(store.summaries)
        cls._write(target, [store.part(i) for i in range(n_chunks)], summary, key, key_fields or {})
        dataset = cls.load(target, key)
        if dataset is None:
            raise RuntimeError(f"the chat-data cache just written to {target} cannot be read back")
        shutil.rmtree(store.directory, ignore_errors=True)
        dataset.summary, dataset.from_cache = summary, False
        return dataset

    # ------------------------------------------------------------------------------------------- caching

    @staticmethod
    def _write(
        directory: Path,
        parts: Sequence[Callable[[str], torch.Tensor]],
        summary: DataSummary,
        key: str,
        key_fields: dict[str, Any],
    ) -> None:
        manifest_path = directory / MANIFEST_FILE
        manifest_path.unlink(missing_ok=True)  # the data file changes below: no manifest may vouch for it meanwhile
        write_rows_file(directory / DATA_FILE, parts, summary.rows_kept, summary.tokens)
        manifest = {
            "format": CACHE_FORMAT,
            "key": key,
            "key_fields": key_fields,
            "rows": summary.rows_kept,
            "tokens": summary.tokens,
            "summary": asdict(summary),
            "data_sha256": file_sha256(directory / DATA_FILE),
        }
        with atomic_file(manifest_path) as tmp:
            tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))

    def save(self, directory: str | Path, key: str, key_fields: dict[str, Any]) -> Path:
        """Write ``data.safetensors`` then ``manifest.json`` (each atomically; the manifest commits) into
        ``directory``."""
        directory = Path(directory)
        tensors = {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "lengths": self.lengths(),
            "source_file": self.source_file,
            "source_line": self.source_line,
        }
        rows, tokens = len(self), self.input_ids.numel()
        summary = DataSummary(**asdict(self.summary))
        summary.rows_kept, summary.tokens = rows, tokens
        self._write(directory, [tensors.__getitem__], summary, key, key_fields)
        self.key = key
        return directory

    @classmethod
    def load(cls, directory: str | Path, key: str) -> TokenizedChatDataset | None:
        """The cached dataset for ``key`` (memory-mapped), or None if absent, of another key/format, or unreadable."""
        directory = Path(directory)
        try:
            manifest = json.loads((directory / MANIFEST_FILE).read_text())
            if manifest.get("format") != CACHE_FORMAT or manifest.get("key") != key:
                return None
            path = directory / DATA_FILE
            if file_sha256(path) != manifest.get("data_sha256"):  # a damaged cache is rebuilt, never reused
                raise ValueError(f"{path} does not match the checksum its manifest recorded")
            t = map_safetensors(path, mmap=path.stat().st_size >= MMAP_MIN_BYTES)
            rows, tokens = int(manifest["rows"]), int(manifest["tokens"])
            shapes_ok = (
                t["offsets"].numel() == rows + 1
                and t["input_ids"].numel() == tokens == t["loss_mask"].numel()
                and t["source_file"].numel() == rows == t["source_line"].numel()
                and int(t["offsets"][-1]) == tokens
            )
            if not shapes_ok:
                raise ValueError(f"{directory / DATA_FILE} does not hold the {rows} rows / {tokens} tokens listed")
            summary = DataSummary(**manifest["summary"])
            return cls(
                t["input_ids"], t["loss_mask"], t["offsets"], t["source_file"], t["source_line"], summary, key, True
            )
        except Exception as exc:  # any unreadable cache (truncated file, bad header, ...) is rebuilt
            if (directory / MANIFEST_FILE).exists():
                log.warning("ignoring unreadable chat-data cache %s (%s); re-tokenizing", directory, exc)
            return None

    @classmethod
    def _cached(cls, target: Path, key: str, sources: Sequence[Source]) -> TokenizedChatDataset | None:
        cached = cls.load(target, key)
        return None if cached is None else _cached_summary(cached, sources)

    @classmethod
    def build_or_load(
        cls,
        files: Sequence[str | Path],
        tokenizer: Any,
        recovery: LossMaskRecovery,
        options: EncodeOptions,
        *,
        cache_dir: str | Path | None,
        workers: int | None = None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> TokenizedChatDataset:
        """Load from ``cache_dir/<key>`` when the key matches, else build (and write the cache if enabled).

        One process builds a key at a time (:mod:`lightning_eagle.data.cache_lock`): another building it waits, then
        reads what the first committed, so nodes may share ``cache_dir``.

        ``files``: files, globs and directories (see :func:`lightning_eagle.data.formats.expand_paths`)."""
        sources = resolve_sources(files, options.format)
        formats = [s.format for s in sources]
        key = cache_key([file_sha256(s.path) for s in sources], tokenizer.fingerprint, options, formats)
        key_fields = {"options": options.key_fields(), "tokenizer": tokenizer.fingerprint, "formats": formats}
        if cache_dir is None:
            dataset = cls.build(
                files, tokenizer, recovery, options, workers=workers, sources=sources, key=key, chunk_rows=chunk_rows
            )
        else:
            target = Path(cache_dir) / key
            cached = cls._cached(target, key, sources)
            if cached is not None:
                return cached
            with cache_build_lock(target):  # one builder per key; the others wait here, then read its cache
                cached = cls._cached(target, key, sources)
                if cached is not None:
                    return cached
                dataset = cls.build(
                    files, tokenizer, recovery, options, workers=workers, sources=sources, cache_to=target, key=key,
                    key_fields=key_fields, chunk_rows=chunk_rows,
                )  # fmt: skip
        dataset.key = key
        report = log.warning if dataset.summary.rows_bad_skipped else log.info
        report("chat data: %s", dataset.summary.describe())
        return dataset


def _cached_summary(dataset: TokenizedChatDataset, sources: Sequence[Source]) -> TokenizedChatDataset:
    dataset.summary.files = [s.path for s in sources]
    dataset.summary.formats = [s.format for s in sources]
    if dataset.summary.rows_bad_skipped:  # repeat the warning: skipping is never silent
        log.warning("chat data (cached): %s", dataset.summary.describe())
    return dataset


def _concatenate(parts: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    def cat(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p[name] for p in parts]) if parts else torch.zeros(0, dtype=dtype)

    lengths = cat("lengths", torch.int64)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    return (
        cat("input_ids", torch.int32),
        cat("loss_mask", torch.uint8),
        offsets,
        cat("source_file", torch.int32),
        cat("source_line", torch.int32),
    )


# --------------------------------------------------------------------------------------------- batching


def collate_chat_rows(
    rows: Sequence[dict[str, torch.Tensor]], pad_token_id: int, pad_to: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row (or ``pad_to``): ``input_ids`` (pad id), ``attention_mask``, ``loss_mask``."""
    if not rows:
        raise ValueError("cannot collate an empty batch")
    length = max(r["input_ids"].numel() for r in rows)
    if pad_to is not None:
        if length > pad_to:
            raise ValueError(f"row of {length} tokens exceeds pad_to={pad_to}")
        length = pad_to
    batch = len(rows)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    loss_mask = torch.zeros((batch, length), dtype=torch.long)
    for i, r in enumerate(rows):
        n = r["input_ids"].numel()
        input_ids[i, :n] = r["input_ids"]
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = r["loss_mask"]
    if int(loss_mask.sum()) == 0:
        # Rows without supervision are dropped at tokenization time, so this is a pipeline bug, not bad data.
        raise RuntimeError("batch has no supervised token (every loss_mask is zero)")
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
