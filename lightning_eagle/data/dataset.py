"""Tokenizing chat files into masked rows, cached on disk as safetensors + a JSON manifest (never pickle).

Pipeline per row (`chat_and_loss_mask.md` §4.4): read and normalize (:mod:`lightning_eagle.data.formats`:
ShareGPT / OpenAI / pre-tokenized rows from JSON, JSONL, ``.gz``/``.zst``, Parquet) -> validate -> render K3 with
``add_generation_prompt=False`` -> right-cut to ``max_length`` -> recover the loss mask on the cut ids (pre-tokenized
rows keep a stored ``loss_mask``) -> drop rows with no supervised token. Every skipped, truncated or dropped row is
counted in :class:`DataSummary`.

Scale: rows are streamed in chunks of ``chunk_rows`` (never all of a file in memory) to the tokenizer worker pool,
and each finished chunk is written to ``<cache>/<key>/chunks/`` at once (atomically), so a killed run resumes with its
completed chunks. At the end the chunks are concatenated, one tensor at a time, into ``data.safetensors`` (a standard
safetensors file), ``manifest.json`` is written last (the commit point) and the chunks are removed. Reading the cache
memory-maps ``data.safetensors``: a dataset is not loaded into RAM, pages are read when rows are.

The cache key hashes the file contents, each file's format, the tokenizer fingerprint and every option that changes
ids or masks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import struct
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from lightning_eagle.atomic import atomic_file
from lightning_eagle.data.formats import TOO_DEEP, Source, iter_items, prepare_row, resolve_sources, source_field
from lightning_eagle.data.loss_mask import LossMaskRecovery
from lightning_eagle.data.render_k2 import build_k2_segments
from lightning_eagle.data.render_k3 import ChatFormatError, build_k3_segments, encode_segments
from lightning_eagle.data.rows import DataRowError, RawLine, RawRow, RowProblem, validate_row
from lightning_eagle.data.tokenizer import KimiTokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = "lightning_eagle.chat_cache/3"  # 3: supervision counted after the one-token shift
CHUNK_FORMAT = "lightning_eagle.chat_cache_chunk/2"
MAX_BAD_ROW_EXAMPLES = 20
# Below this many rows, spawning worker processes costs more than it saves.
MIN_ROWS_FOR_WORKERS = 2000
# Rows read, sent to the workers and written per chunk: bounds the parent's memory (two chunks of parsed rows in
# flight) and what a killed run loses.
DEFAULT_CHUNK_ROWS = 2048
# Short segments (markers, tag and attribute names, role names) repeat in every row: their ids are memoized.
MEMO_MAX_CHARS = 48
MEMO_MAX_ENTRIES = 1 << 16

# Caches at least this big are memory-mapped; smaller ones are read into memory (nothing to gain from a mapping, and
# a row file replaced or truncated under a running process cannot take a mapped dataset with it).
MMAP_MIN_BYTES = 64 << 20

DATA_FILE = "data.safetensors"
MANIFEST_FILE = "manifest.json"
CHUNKS_DIR = "chunks"


@dataclass
class DataSummary:
    """What happened to every input row; logged after tokenization and kept in the cache manifest."""

    files: list[str] = field(default_factory=list)
    rows_read: int = 0
    rows_bad_skipped: int = 0
    bad_row_examples: list[str] = field(default_factory=list)
    rows_truncated: int = 0
    rows_without_supervision: int = 0
    rows_kept: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    formats: list[str] = field(default_factory=list)  # the format each file was read in (parallel to ``files``)

    def describe(self) -> str:
        counts = {f: self.formats.count(f) for f in dict.fromkeys(self.formats)}
        read_as = f" ({', '.join(f'{n} {f}' for f, n in counts.items())})" if counts else ""
        text = (
            f"{self.rows_read} rows read from {len(self.files)} file(s){read_as}: {self.rows_kept} kept, "
            f"{self.rows_bad_skipped} malformed and skipped, {self.rows_without_supervision} dropped with nothing to "
            f"predict (no supervised token after the first), {self.rows_truncated} truncated to max_length; "
            f"{self.tokens} tokens, "
            f"{self.supervised_tokens} supervised"
        )
        if self.bad_row_examples:
            text += "\nmalformed rows:\n  " + "\n  ".join(self.bad_row_examples)
        return text

    def add_counts(self, other: DataSummary) -> None:
        """Add the row/token counts (and bad-row examples, up to the cap) of a chunk."""
        for name in (
            "rows_read",
            "rows_bad_skipped",
            "rows_truncated",
            "rows_without_supervision",
            "rows_kept",
            "tokens",
            "supervised_tokens",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        room = MAX_BAD_ROW_EXAMPLES - len(self.bad_row_examples)
        self.bad_row_examples += other.bad_row_examples[: max(room, 0)]


@dataclass(frozen=True)
class EncodeOptions:
    """Everything besides the files that determines the tokenized rows (part of the cache key).

    ``format`` is the *requested* format (``auto`` / ``sharegpt`` / ``openai`` / ``tokens``); the key holds the format
    each file was actually read in instead, so ``auto`` and forcing what it detects share a cache entry."""

    max_length: int
    render_options: dict[str, Any]
    recovery_name: str
    recovery_options: dict[str, Any]
    on_bad_row: Literal["raise", "skip"] = "raise"
    format: str = "auto"

    def key_fields(self) -> dict[str, Any]:
        fields = asdict(self)
        fields.pop("format")
        return fields


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


# --------------------------------------------------------------------------------------------- per-row encoding


class _Job(NamedTuple):
    """One stored row (a JSONL line still unparsed, or a parsed record) and the format of its file."""

    format: str
    item: RawLine | RawRow


class _Encoder:
    """Renders, cuts and masks one validated row. Picklable, so worker processes get their own copy."""

    def __init__(self, tokenizer: Any, recovery: LossMaskRecovery, options: EncodeOptions) -> None:
        self.tokenizer, self.recovery, self.options = tokenizer, recovery, options
        self.vocab_limit = tokenizer.vocab_size  # ids the model can embed; added-token ids lie above it
        self.k2 = getattr(tokenizer, "chat_format", "k3") == "k2"
        # Memoizing is exact for our tokenizer: it encodes segment by segment, each independently of the others.
        self.memoize = isinstance(tokenizer, KimiTokenizer) and (
            type(tokenizer).encode_segments is KimiTokenizer.encode_segments
        )
        self._memo: dict[tuple[str, bool], list[int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_memo": {}}

    def __call__(self, job: _Job) -> tuple:
        """``("ok", ids, mask, truncated)`` (ids an ``array("i")``, mask ``bytes``: cheap to send between processes)
        or ``("bad", field, problem)``. Parsing and normalizing happen here too, so they run in the workers."""
        try:
            row = prepare_row(job.item, job.format)
        except RowProblem as exc:
            return ("bad", exc.field, exc.problem)
        try:
            kind = validate_row(row.data, self.vocab_limit)
            if kind == "chat":
                ids = self._encode(self._segments(row.data))
                stored_mask = None
            else:
                ids, stored_mask = list(row.data["input_ids"]), row.data.get("loss_mask")
        except RowProblem as exc:
            return ("bad", source_field(exc.field, row.fields), exc.problem)
        except ChatFormatError as exc:
            field_name, _, problem = str(exc).partition(": ")
            return ("bad", source_field(field_name, row.fields), problem or str(exc))
        except RecursionError:
            return ("bad", "<json>", TOO_DEEP)
        max_length = self.options.max_length
        truncated = len(ids) > max_length
        ids = ids[:max_length]
        if stored_mask is not None:
            mask = list(stored_mask[:max_length])
        else:
            mask = self.recovery.compute(self.tokenizer, ids, **self.options.recovery_options).tolist()
            if len(mask) != len(ids):
                raise RuntimeError(
                    f"recovery {self.recovery.name!r} returned {len(mask)} mask values for {len(ids)} ids"
                )
        return ("ok", array("i", ids), bytes(mask), truncated)

    def _encode(self, segments: Sequence[Any]) -> list[int]:
        if not self.memoize:
            return encode_segments(self.tokenizer, segments)
        ids: list[int] = []
        memo, encode = self._memo, self.tokenizer.encode
        for segment in segments:
            text, allow = segment[0], bool(segment[1])
            if not text:
                continue
            if len(text) > MEMO_MAX_CHARS:
                ids += encode(text, allow_special_tokens=allow)
                continue
            piece = memo.get((text, allow))
            if piece is None:
                piece = encode(text, allow_special_tokens=allow)
                if len(memo) < MEMO_MAX_ENTRIES:
                    memo[(text, allow)] = piece
            ids += piece
        return ids

    def _segments(self, data: dict[str, Any]) -> list:
        # Training data never ends in a generation prompt (`chat_and_loss_mask.md` §1.6, §4.4).
        if self.k2:
            thinking = bool(self.options.render_options.get("thinking", False))
            return build_k2_segments(data["messages"], data.get("tools"), thinking=thinking)
        options = {**self.options.render_options, "add_generation_prompt": False}
        return build_k3_segments(data["messages"], data.get("tools"), **options)


_WORKER_ENCODER: _Encoder | None = None


def _init_worker(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder
    torch.set_num_threads(1)


def _encode_in_worker(job: _Job) -> tuple:
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER(job)


def default_tokenize_workers(num_rows: int) -> int:
    if num_rows < MIN_ROWS_FOR_WORKERS:
        return 0
    return max(1, min(8, (os.cpu_count() or 2) - 1))


class _Encoding:
    """Sends chunks of rows to the encoder (in this process, or a pool of spawned workers created on first use) and
    keeps one chunk in flight ahead of the one being consumed, so workers tokenize while this process reads."""

    def __init__(self, encoder: _Encoder, workers: int | None) -> None:
        self.encoder, self.workers = encoder, workers
        self.pool: Any = None
        self.n_workers: int | None = None

    def _decide(self, first_chunk_rows: int, only_chunk: bool) -> int:
        if self.n_workers is None:
            if self.workers is not None:
                self.n_workers = self.workers
            else:
                self.n_workers = default_tokenize_workers(first_chunk_rows if only_chunk else MIN_ROWS_FOR_WORKERS)
        return self.n_workers

    def submit(self, rows: list[_Job], only_chunk: bool) -> Iterator[tuple]:
        n = self._decide(len(rows), only_chunk)
        if n <= 1:
            return map(self.encoder, rows)
        if self.pool is None:
            # spawn, not fork: the parent may already run torch/OpenMP threads, which fork does not survive reliably.
            ctx = multiprocessing.get_context("spawn")
            self.pool = ctx.Pool(n, initializer=_init_worker, initargs=(self.encoder,))
        return self.pool.imap(_encode_in_worker, rows, chunksize=max(1, min(64, len(rows) // (4 * n))))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()  # also stops the workers promptly when a bad row raises
            self.pool.join()
            self.pool = None

    def run(
        self, chunks: Iterable[list[_Job | DataRowError]], reuse: Callable[[int], bool] | None
    ) -> Iterator[tuple[int, list[_Job | DataRowError] | None, Iterator[tuple] | None]]:
        """``(index, items, results)`` per chunk in order; ``(index, None, None)`` for a chunk ``reuse`` accepts."""
        pending: deque = deque()
        for index, items, last in _with_last(chunks):
            if reuse is not None and reuse(index):
                pending.append((index, None, None))
            else:
                rows = [item for item in items if isinstance(item, _Job)]
                pending.append((index, items, self.submit(rows, only_chunk=last and index == 0)))
            while len(pending) > 1:
                yield pending.popleft()
        while pending:
            yield pending.popleft()


def _with_last(chunks: Iterable[Any]) -> Iterator[tuple[int, Any, bool]]:
    iterator = iter(chunks)
    current = next(iterator, None)
    index = 0
    while current is not None:
        following = next(iterator, None)
        yield index, current, following is None
        current, index = following, index + 1


def _chunks(sources: Sequence[Source], chunk_rows: int) -> Iterator[list[_Job | DataRowError]]:
    """The rows of every source, in order, ``chunk_rows`` at a time (the last chunk may be shorter)."""
    chunk: list[_Job | DataRowError] = []
    for source in sources:
        for item in iter_items(source.path, source.format):
            chunk.append(item if isinstance(item, DataRowError) else _Job(source.format, item))
            if len(chunk) >= chunk_rows:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


class _Part:
    """The kept rows of one chunk (unsupervised rows dropped) and its counts."""

    def __init__(self, file_index: dict[str, int]) -> None:
        self.summary = DataSummary()
        self.file_index = file_index
        self.ids = array("i")  # 4 bytes per token, not a Python int each
        self.masks = array("B")
        self.lengths: list[int] = []
        self.files: list[int] = []
        self.lines: list[int] = []

    def consume(self, items: list[_Job | DataRowError], results: Iterator[tuple], on_bad_row: str) -> None:
        for item in items:
            self.summary.rows_read += 1
            if isinstance(item, DataRowError):
                _handle_bad(self.summary, item, on_bad_row)
                continue
            result = next(results)
            where = item.item
            if result[0] == "bad":
                _handle_bad(self.summary, DataRowError(where.file, where.line, result[1], result[2]), on_bad_row)
            else:
                self.add(where.file, where.line, *result[1:])

    def add(self, file: str, line: int, ids: array, mask: bytes, truncated: bool) -> None:
        self.summary.rows_truncated += int(truncated)
        # counted after the one-token shift: a supervised first token has no context to be predicted from, so a row
        # supervised only there trains nothing (before: loss 0, tau 1.0, an untrained draft exported, exit 0)
        supervised = mask[1:].count(1)
        if supervised == 0:
            self.summary.rows_without_supervision += 1
            return
        self.ids.extend(ids)
        self.masks.frombytes(mask)
        self.lengths.append(len(ids))
        self.files.append(self.file_index[file])
        self.lines.append(line)
        self.summary.rows_kept += 1
        self.summary.tokens += len(ids)
        self.summary.supervised_tokens += supervised

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": _from_array(self.ids, torch.int32),
            "loss_mask": _from_array(self.masks, torch.uint8),
            "lengths": torch.tensor(self.lengths, dtype=torch.int64),
            "source_file": torch.tensor(self.files, dtype=torch.int32),
            "source_line": torch.tensor(self.lines, dtype=torch.int32),
        }


def _from_array(values: array, dtype: torch.dtype) -> torch.Tensor:
    if not values:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)  # shares (and keeps alive) the array's memory


def _handle_bad(summary: DataSummary, error: DataRowError, on_bad_row: str) -> None:
    if on_bad_row == "raise":
        raise DataRowError(error.file, error.line, error.field, error.problem, hint=DataRowError.SKIP_HINT)
    summary.rows_bad_skipped += 1
    if len(summary.bad_row_examples) < MAX_BAD_ROW_EXAMPLES:
        summary.bad_row_examples.append(str(error))


# --------------------------------------------------------------------------------------------- on-disk layout

# Order in data.safetensors: widest dtype first, so every tensor starts aligned to its element size and maps in place.
_ROW_TENSORS = (
    ("offsets", torch.int64),
    ("input_ids", torch.int32),
    ("source_file", torch.int32),
    ("source_line", torch.int32),
    ("loss_mask", torch.uint8),
)
_ST_NAMES = {torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.int16: "I16", torch.bool: "BOOL"}
_ST_DTYPES = {v: k for k, v in _ST_NAMES.items()}


class _ChunkStore:
    """Chunk files ``chunk_NNNNNN.safetensors`` of one cache key (safetensors with the chunk's counts as metadata)."""

    def __init__(self, directory: Path, key: str, chunk_rows: int) -> None:
        self.directory, self.key, self.chunk_rows = directory, key, chunk_rows
        self.summaries: dict[int, DataSummary] = {}

    def path(self, index: int) -> Path:
        return self.directory / f"chunk_{index:06d}.safetensors"

    def reusable(self, index: int) -> bool:
        """True (and its counts remembered) when chunk ``index`` was completed by an earlier run of the same key."""
        from safetensors import safe_open

        path = self.path(index)
        if not path.is_file():
            return False
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
            ok = (
                meta.get("format") == CHUNK_FORMAT
                and meta.get("key") == self.key
                and meta.get("chunk_rows") == str(self.chunk_rows)
                and meta.get("index") == str(index)
                and names == {"input_ids", "loss_mask", "lengths", "source_file", "source_line"}
            )
            if ok:
                self.summaries[index] = DataSummary(**json.loads(meta["summary"]))
            return ok
        except Exception as exc:  # a damaged chunk is recomputed
            log.warning("recomputing chat-data chunk %s (%s)", path, exc)
            return False

    def save(self, index: int, tensors: dict[str, torch.Tensor], summary: DataSummary) -> None:
        from safetensors.torch import save_file

        meta = {
            "format": CHUNK_FORMAT,
            "key": self.key,
            "chunk_rows": str(self.chunk_rows),
            "index": str(index),
            "summary": json.dumps(asdict(summary)),
        }
        with atomic_file(self.path(index)) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        self.summaries[index] = summary

    def part(self, index: int) -> Callable[[str], torch.Tensor]:
        from safetensors import safe_open

        path = str(self.path(index))

        def get(name: str) -> torch.Tensor:
            with safe_open(path, "pt") as f:
                return f.get_tensor(name)

        return get

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        try:
            self.directory.parent.rmdir()  # the key folder, when nothing else is in it
        except OSError:
            pass


def write_rows_file(path: str | Path, parts: Sequence[Callable[[str], torch.Tensor]], rows: int, tokens: int) -> None:
    """Concatenate parts (each: tensor name -> ``input_ids``/``loss_mask``/``lengths``/``source_file``/
    ``source_line``) into one safetensors file, atomically, one tensor of one part in memory at a time."""
    if sys.byteorder != "little":  # pragma: no cover
        raise RuntimeError("the chat-data cache is written in little-endian byte order")
    sizes = {"offsets": rows + 1, "input_ids": tokens, "source_file": rows, "source_line": rows, "loss_mask": tokens}
    header: dict[str, Any] = {"__metadata__": {"format": CACHE_FORMAT}}
    position = 0
    for name, dtype in _ROW_TENSORS:
        nbytes = sizes[name] * torch.empty(0, dtype=dtype).element_size()
        header[name] = {
            "dtype": _ST_NAMES[dtype],
            "shape": [sizes[name]],
            "data_offsets": [position, position + nbytes],
        }
        position += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
    written = {name: 0 for name, _ in _ROW_TENSORS}

    def put(f: Any, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        tensor = tensor.to(dtype).contiguous()
        written[name] += tensor.numel()
        f.write(tensor.numpy().tobytes())

    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        put(f, "offsets", torch.zeros(1, dtype=torch.int64), torch.int64)
        base = 0
        for part in parts:
            lengths = part("lengths").to(torch.int64)
            if lengths.numel():
                ends = lengths.cumsum(0) + base
                put(f, "offsets", ends, torch.int64)
                base = int(ends[-1])
        for name, dtype in _ROW_TENSORS[1:]:
            for part in parts:
                put(f, name, part(name), dtype)
        if written != sizes:
            raise RuntimeError(f"chat-data cache parts hold {written} values, their counts say {sizes}")


def map_safetensors(path: str | Path, mmap: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, memory-mapped (copy-on-write, read lazily) or, with ``mmap=False``, read
    into memory. Raises ``ValueError`` for a file that is not complete, valid safetensors."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short for safetensors ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        header = json.loads(f.read(n))
    base = 8 + n
    buffer = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    tensors: dict[str, torch.Tensor] = {}
    end_max = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has an unsupported dtype {meta.get('dtype')!r}")
        start, end = meta["data_offsets"]
        shape = list(meta["shape"])
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = 1
        for dim in shape:
            count *= dim
        if not (0 <= start <= end <= size - base) or end - start != count * itemsize:
            raise ValueError(f"{path}: tensor {name!r} does not fit the file")
        raw = buffer[base + start : base + end]
        if (base + start) % itemsize:
            raw = raw.clone()  # not aligned in the file (another writer): read it
        tensors[name] = raw.view(dtype).reshape(shape)
        if not mmap:
            tensors[name] = tensors[name].clone()
        end_max = max(end_max, end)
    if base + end_max != size:
        raise ValueError(f"{path}: {size - base - end_max} bytes beyond the last tensor (truncated or appended to)")
    return tensors


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
        ``manifest.json`` are written and the result is the memory-mapped cache."""
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        if sources is None:
            sources = resolve_sources(files, options.format)
        summary = DataSummary(files=[s.path for s in sources], formats=[s.format for s in sources])
        file_index = {name: i for i, name in enumerate(summary.files)}
        store = _ChunkStore(Path(cache_to) / CHUNKS_DIR, key, chunk_rows) if cache_to is not None else None
        parts: list[dict[str, torch.Tensor]] = []
        encoding = _Encoding(_Encoder(tokenizer, recovery, options), workers)
        reused = 0
        try:
            for index, items, results in encoding.run(_chunks(sources, chunk_rows), store.reusable if store else None):
                if items is None:
                    assert store is not None
                    summary.add_counts(store.summaries[index])
                    reused += 1
                    continue
                part = _Part(file_index)
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

        ``files``: files, globs and directories (see :func:`lightning_eagle.data.formats.expand_paths`)."""
        sources = resolve_sources(files, options.format)
        formats = [s.format for s in sources]
        key = cache_key([file_sha256(s.path) for s in sources], tokenizer.fingerprint, options, formats)
        target = Path(cache_dir) / key if cache_dir is not None else None
        if target is not None:
            cached = cls.load(target, key)
            if cached is not None:
                cached.summary.files = [s.path for s in sources]
                cached.summary.formats = formats
                if cached.summary.rows_bad_skipped:  # repeat the warning: skipping is never silent
                    log.warning("chat data (cached): %s", cached.summary.describe())
                return cached
        key_fields = {"options": options.key_fields(), "tokenizer": tokenizer.fingerprint, "formats": formats}
        dataset = cls.build(
            files, tokenizer, recovery, options, workers=workers, sources=sources, cache_to=target, key=key,
            key_fields=key_fields, chunk_rows=chunk_rows,
        )  # fmt: skip
        dataset.key = key
        report = log.warning if dataset.summary.rows_bad_skipped else log.info
        report("chat data: %s", dataset.summary.describe())
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
