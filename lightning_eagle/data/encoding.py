"""Chat rows to token ids and loss masks, streamed chunk by chunk (``chat_and_loss_mask.md`` §4.4).

Per row: parse and normalize (:mod:`lightning_eagle.data.formats`) -> validate -> render K3 (or K2) with
``add_generation_prompt=False`` (a text longer than can be kept is encoded only that far, so any line is tokenized
in bounded memory and time) -> right-cut to ``max_length`` -> recover the loss mask on the cut ids (pre-tokenized rows
keep a stored ``loss_mask``) -> drop rows with no supervised token after the first. Every skipped, truncated or dropped
row is counted in :class:`DataSummary`.

Rows are read ``chunk_rows`` at a time (:func:`read_chunks`, never all of a file in memory) and encoded in this
process or by a pool of spawned workers (:class:`ChunkEncoding`), one chunk in flight ahead of the one being
consumed; :class:`EncodedChunk` collects a chunk's kept rows as flat tensors. Where those tensors go (memory, chunk
files, the cache's row file) is :mod:`lightning_eagle.data.dataset`'s business.
"""

from __future__ import annotations

import multiprocessing
import os
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

import torch

from lightning_eagle.data.formats import TOO_DEEP, Source, iter_items, prepare_row, source_field
from lightning_eagle.data.loss_mask import LossMaskRecovery
from lightning_eagle.data.render_k2 import build_k2_segments
from lightning_eagle.data.render_k3 import ChatFormatError, build_k3_segments, encode_segments
from lightning_eagle.data.rows import DataRowError, RawLine, RawRow, RowProblem, validate_row
from lightning_eagle.data.tokenizer import MAX_ENCODE_CHARS as ENCODE_WINDOW_CHARS
from lightning_eagle.data.tokenizer import KimiTokenizer

MAX_BAD_ROW_EXAMPLES = 20
# Below this many rows, spawning worker processes costs more than it saves.
MIN_ROWS_FOR_WORKERS = 2000
# Rows read, sent to the workers and written per chunk: bounds the parent's memory (two chunks of parsed rows in
# flight) and what a killed run loses.
DEFAULT_CHUNK_ROWS = 2048
# Short segments (markers, tag and attribute names, role names) repeat in every row: their ids are memoized.
MEMO_MAX_CHARS = 48
MEMO_MAX_ENTRIES = 1 << 16
# The max_length values whose cuts every tokenization counts (with the configured one), for the data report's table.
REPORT_CUT_LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)


def cut_lengths(max_length: int) -> tuple[int, ...]:
    """The lengths :class:`DataSummary` counts cuts at: :data:`REPORT_CUT_LENGTHS` and ``max_length``, ascending."""
    return tuple(sorted({*REPORT_CUT_LENGTHS, int(max_length)}))


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
    rendered_tokens: int = 0  # tokens of every tokenized row before the cut (kept or dropped)
    # str(L) -> [rows longer than L, tokens beyond L] over every tokenized row, for each L of ``cut_lengths``
    length_cuts: dict[str, list[int]] = field(default_factory=dict)

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
            "rendered_tokens",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for length, (rows, tokens) in other.length_cuts.items():
            mine = self.length_cuts.setdefault(length, [0, 0])
            mine[0] += rows
            mine[1] += tokens
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


class RowJob(NamedTuple):
    """One stored row (a JSONL line still unparsed, or a parsed record) and the format of its file."""

    format: str
    item: RawLine | RawRow


class RowEncoder:
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
        # Tokens a row is encoded to at most: enough for max_length and for every length the data report counts cuts
        # at (whether a row is longer than each stays exact; how many tokens a cut drops is a lower bound past it).
        self.token_budget = max(cut_lengths(options.max_length)) + 1
        # Our encode works window by window (ENCODE_WINDOW_CHARS characters, each independently of the others), so
        # stopping after the window that reaches the budget keeps exactly the tokens encoding it whole would keep.
        self.windowed = self.memoize and type(tokenizer).encode is KimiTokenizer.encode

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_memo": {}}

    def __call__(self, job: RowJob) -> tuple:
        """``("ok", ids, mask, full_length)`` (ids an ``array("i")`` cut to ``max_length``, mask ``bytes``: cheap to
        send between processes; ``full_length`` the row's length before the cut) or ``("bad", field, problem)``.
        A row longer than ``token_budget`` is encoded only that far, so its ``full_length`` is then a lower bound
        (past the budget). Parsing and normalizing happen here too, so they run in the workers."""
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
        max_length, full_length = self.options.max_length, len(ids)
        ids = ids[:max_length]
        if stored_mask is not None:
            mask = list(stored_mask[:max_length])
        else:
            mask = self.recovery.compute(self.tokenizer, ids, **self.options.recovery_options).tolist()
            if len(mask) != len(ids):
                raise RuntimeError(
                    f"recovery {self.recovery.name!r} returned {len(mask)} mask values for {len(ids)} ids"
                )
        return ("ok", array("i", ids), bytes(mask), full_length)

    def _encode(self, segments: Sequence[Any]) -> list[int]:
        if not self.memoize:
            return encode_segments(self.tokenizer, segments)
        ids: list[int] = []
        memo, encode = self._memo, self.tokenizer.encode
        for segment in segments:
            if len(ids) >= self.token_budget:
                break  # nothing after this can be kept (each segment encodes independently of the others)
            text, allow = segment[0], bool(segment[1])
            if not text:
                continue
            if len(text) > MEMO_MAX_CHARS:
                ids += self._encode_long(text, allow, self.token_budget - len(ids))
                continue
            piece = memo.get((text, allow))
            if piece is None:
                piece = encode(text, allow_special_tokens=allow)
                if len(memo) < MEMO_MAX_ENTRIES:
                    memo[(text, allow)] = piece
            ids += piece
        return ids

    def _encode_long(self, text: str, allow: bool, wanted: int) -> list[int]:
        """``encode(text)``, or, for a text longer than one window, its windows until ``wanted`` tokens are in: the
        same first tokens, and memory and time bounded whatever the length of the text (a 1 GiB line was encoded
        whole, at ~20x its size, although only its first ``max_length`` tokens were kept)."""
        encode = self.tokenizer.encode
        if not self.windowed or len(text) <= ENCODE_WINDOW_CHARS:
            return encode(text, allow_special_tokens=allow)
        ids: list[int] = []
        for start in range(0, len(text), ENCODE_WINDOW_CHARS):
            ids += encode(text[start : start + ENCODE_WINDOW_CHARS], allow_special_tokens=allow)
            if len(ids) >= wanted:
                break
        return ids

    def _segments(self, data: dict[str, Any]) -> list:
        # Training data never ends in a generation prompt (`chat_and_loss_mask.md` §1.6, §4.4).
        if self.k2:
            thinking = bool(self.options.render_options.get("thinking", False))
            return build_k2_segments(data["messages"], data.get("tools"), thinking=thinking)
        options = {**self.options.render_options, "add_generation_prompt": False}
        return build_k3_segments(data["messages"], data.get("tools"), **options)


_WORKER_ENCODER: RowEncoder | None = None


def _init_worker(encoder: RowEncoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder
    torch.set_num_threads(1)


def _encode_in_worker(job: RowJob) -> tuple:
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER(job)


def default_tokenize_workers(num_rows: int) -> int:
    if num_rows < MIN_ROWS_FOR_WORKERS:
        return 0
    return max(1, min(8, (os.cpu_count() or 2) - 1))


class ChunkEncoding:
    """Sends chunks of rows to the encoder (in this process, or a pool of spawned workers created on first use) and
    keeps one chunk in flight ahead of the one being consumed, so workers tokenize while this process reads."""

    def __init__(self, encoder: RowEncoder, workers: int | None) -> None:
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

    def submit(self, rows: list[RowJob], only_chunk: bool) -> Iterator[tuple]:
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
        self, chunks: Iterable[list[RowJob | DataRowError]], reuse: Callable[[int], bool] | None
    ) -> Iterator[tuple[int, list[RowJob | DataRowError] | None, Iterator[tuple] | None]]:
        """``(index, items, results)`` per chunk in order; ``(index, None, None)`` for a chunk ``reuse`` accepts."""
        pending: deque = deque()
        for index, items, last in _with_last(chunks):
            if reuse is not None and reuse(index):
                pending.append((index, None, None))
            else:
                rows = [item for item in items if isinstance(item, RowJob)]
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


def read_chunks(sources: Sequence[Source], chunk_rows: int) -> Iterator[list[RowJob | DataRowError]]:
    """The rows of every source, in order, ``chunk_rows`` at a time (the last chunk may be shorter)."""
    chunk: list[RowJob | DataRowError] = []
    for source in sources:
        for item in iter_items(source.path, source.format):
            chunk.append(item if isinstance(item, DataRowError) else RowJob(source.format, item))
            if len(chunk) >= chunk_rows:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


class EncodedChunk:
    """The kept rows of one chunk (unsupervised rows dropped) and its counts; cuts are counted at each length of
    ``cuts`` (:func:`cut_lengths`) over every tokenized row."""

    def __init__(self, file_index: dict[str, int], cuts: Sequence[int] = ()) -> None:
        self.summary = DataSummary(length_cuts={str(n): [0, 0] for n in cuts})
        self.cuts = tuple(int(n) for n in cuts)
        self.file_index = file_index
        self.ids = array("i")  # 4 bytes per token, not a Python int each
        self.masks = array("B")
        self.lengths: list[int] = []
        self.files: list[int] = []
        self.lines: list[int] = []

    def consume(self, items: list[RowJob | DataRowError], results: Iterator[tuple], on_bad_row: str) -> None:
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

    def add(self, file: str, line: int, ids: array, mask: bytes, full_length: int) -> None:
        self.summary.rows_truncated += int(full_length > len(ids))
        self.summary.rendered_tokens += full_length
        for n in self.cuts:
            if full_length > n:
                counts = self.summary.length_cuts[str(n)]
                counts[0] += 1
                counts[1] += full_length - n
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
