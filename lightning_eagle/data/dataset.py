"""Tokenizing chat files into masked rows, cached on disk as safetensors + a JSON manifest (never pickle).

Pipeline per row (chat spec §4.4): validate -> render K3 with ``add_generation_prompt=False`` -> right-cut to
``max_length`` -> recover the loss mask on the cut ids (pre-tokenized rows keep a stored ``loss_mask``) -> drop rows
with no supervised token. Every skipped, truncated or dropped row is counted in :class:`DataSummary`.
The cache key hashes the file contents, the tokenizer fingerprint and every option that changes ids or masks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_eagle.atomic import atomic_dir
from lightning_eagle.data.loss_mask import LossMaskRecovery
from lightning_eagle.data.render_k2 import build_k2_segments
from lightning_eagle.data.render_k3 import ChatFormatError, build_k3_segments, encode_segments
from lightning_eagle.data.rows import DataRowError, RawRow, RowProblem, iter_raw_rows, validate_row

log = logging.getLogger(__name__)

CACHE_FORMAT = "lightning_eagle.chat_cache/1"
MAX_BAD_ROW_EXAMPLES = 20
# Below this many rows, spawning worker processes costs more than it saves.
MIN_ROWS_FOR_WORKERS = 2000


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

    def describe(self) -> str:
        text = (
            f"{self.rows_read} rows read from {len(self.files)} file(s): {self.rows_kept} kept, "
            f"{self.rows_bad_skipped} malformed and skipped, {self.rows_without_supervision} dropped without any "
            f"supervised token, {self.rows_truncated} truncated to max_length; {self.tokens} tokens, "
            f"{self.supervised_tokens} supervised"
        )
        if self.bad_row_examples:
            text += "\nmalformed rows:\n  " + "\n  ".join(self.bad_row_examples)
        return text


@dataclass(frozen=True)
class EncodeOptions:
    """Everything besides the files that determines the tokenized rows (part of the cache key)."""

    max_length: int
    render_options: dict[str, Any]
    recovery_name: str
    recovery_options: dict[str, Any]
    on_bad_row: Literal["raise", "skip"] = "raise"

    def key_fields(self) -> dict[str, Any]:
        return asdict(self)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_key(file_hashes: Sequence[str], tokenizer_fingerprint: str, options: EncodeOptions) -> str:
    payload = {
        "format": CACHE_FORMAT,
        "files": list(file_hashes),
        "tokenizer": tokenizer_fingerprint,
        "options": options.key_fields(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


# --------------------------------------------------------------------------------------------- per-row encoding


class _Encoder:
    """Renders, cuts and masks one validated row. Picklable, so worker processes get their own copy."""

    def __init__(self, tokenizer: Any, recovery: LossMaskRecovery, options: EncodeOptions) -> None:
        self.tokenizer, self.recovery, self.options = tokenizer, recovery, options
        self.vocab_limit = tokenizer.vocab_size  # ids the model can embed; added-token ids lie above it
        self.k2 = getattr(tokenizer, "chat_format", "k3") == "k2"

    def __call__(self, row: RawRow) -> tuple:
        """``("ok", ids, mask, truncated)`` or ``("bad", field, problem)``."""
        try:
            kind = validate_row(row.data, self.vocab_limit)
            if kind == "chat":
                ids = encode_segments(self.tokenizer, self._segments(row.data))
                stored_mask = None
            else:
                ids, stored_mask = list(row.data["input_ids"]), row.data.get("loss_mask")
        except RowProblem as exc:
            return ("bad", exc.field, exc.problem)
        except ChatFormatError as exc:
            field_name, _, problem = str(exc).partition(": ")
            return ("bad", field_name, problem or str(exc))
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
        return ("ok", ids, mask, truncated)

    def _segments(self, data: dict[str, Any]) -> list:
        # Training data never ends in a generation prompt (chat spec §1.6, §4.4).
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


def _encode_in_worker(row: RawRow) -> tuple:
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER(row)


def _map_rows(encoder: _Encoder, rows: list[RawRow], workers: int) -> Iterable[tuple]:
    if workers <= 1:
        return map(encoder, rows)
    # spawn, not fork: the parent may already run torch/OpenMP threads, which fork does not survive reliably.
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(encoder,))

    def results() -> Iterable[tuple]:
        try:
            yield from pool.imap(_encode_in_worker, rows, chunksize=max(1, min(256, len(rows) // (4 * workers))))
        finally:
            pool.terminate()
            pool.join()

    return results()


def default_tokenize_workers(num_rows: int) -> int:
    if num_rows < MIN_ROWS_FOR_WORKERS:
        return 0
    return max(1, min(8, (os.cpu_count() or 2) - 1))


# --------------------------------------------------------------------------------------------- the dataset


class TokenizedChatDataset(torch.utils.data.Dataset):
    """Variable-length tokenized rows: ``input_ids`` and ``loss_mask`` LongTensors per item.

    Stored flat (``input_ids`` int32, ``loss_mask`` uint8, ``offsets`` int64 [N+1]) plus the source file index and
    line of every row, so any row can be traced back to its input.
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
        """(file, 1-based line) the row came from."""
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
    ) -> TokenizedChatDataset:
        """Read, validate, tokenize and mask every row of ``files`` (in order)."""
        summary = DataSummary(files=[str(f) for f in files])
        raw: list[RawRow] = []
        for f in files:
            for item in iter_raw_rows(f):
                summary.rows_read += 1
                if isinstance(item, DataRowError):
                    _handle_bad(summary, item, options.on_bad_row)
                else:
                    raw.append(item)
        encoder = _Encoder(tokenizer, recovery, options)
        n_workers = default_tokenize_workers(len(raw)) if workers is None else workers
        kept = _KeptRows(summary)
        results = _map_rows(encoder, raw, n_workers)
        try:
            for row, result in zip(raw, results):
                if result[0] == "bad":
                    _handle_bad(summary, DataRowError(row.file, row.line, result[1], result[2]), options.on_bad_row)
                else:
                    kept.add(row, *result[1:])
        finally:
            close = getattr(results, "close", None)
            if close is not None:
                close()  # stops worker processes promptly when a bad row raises
        return cls(*kept.tensors(), summary)

    # ------------------------------------------------------------------------------------------- caching

    def save(self, directory: str | Path, key: str, key_fields: dict[str, Any]) -> Path:
        """Write ``data.safetensors`` + ``manifest.json`` atomically into ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        with atomic_dir(directory, overwrite=True) as tmp:
            tensors = {
                "input_ids": self.input_ids,
                "loss_mask": self.loss_mask,
                "offsets": self.offsets,
                "source_file": self.source_file,
                "source_line": self.source_line,
            }
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "data.safetensors"))
            manifest = {"format": CACHE_FORMAT, "key": key, "key_fields": key_fields, "summary": asdict(self.summary)}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        self.key = key
        return directory

    @classmethod
    def load(cls, directory: str | Path, key: str) -> TokenizedChatDataset | None:
        """The cached dataset for ``key``, or None if absent, of another key/format, or unreadable."""
        from safetensors.torch import load_file

        directory = Path(directory)
        try:
            manifest = json.loads((directory / "manifest.json").read_text())
            if manifest.get("format") != CACHE_FORMAT or manifest.get("key") != key:
                return None
            t = load_file(str(directory / "data.safetensors"))
            summary = DataSummary(**manifest["summary"])
            return cls(
                t["input_ids"], t["loss_mask"], t["offsets"], t["source_file"], t["source_line"], summary, key, True
            )
        except Exception as exc:  # any unreadable cache (truncated file, safetensors error, ...) is rebuilt
            if directory.exists():
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
    ) -> TokenizedChatDataset:
        """Load from ``cache_dir/<key>`` when the key matches, else build (and write the cache if enabled)."""
        missing = [str(f) for f in files if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"chat data file(s) not found: {missing}")
        key = cache_key([file_sha256(f) for f in files], tokenizer.fingerprint, options)
        target = Path(cache_dir) / key if cache_dir is not None else None
        if target is not None:
            cached = cls.load(target, key)
            if cached is not None:
                cached.summary.files = [str(f) for f in files]
                if cached.summary.rows_bad_skipped:  # repeat the warning: skipping is never silent
                    log.warning("chat data (cached): %s", cached.summary.describe())
                return cached
        dataset = cls.build(files, tokenizer, recovery, options, workers=workers)
        dataset.key = key
        report = log.warning if dataset.summary.rows_bad_skipped else log.info
        report("chat data: %s", dataset.summary.describe())
        if target is not None:
            dataset.save(target, key, {"options": options.key_fields(), "tokenizer": tokenizer.fingerprint})
        return dataset


class _KeptRows:
    """Accumulates encoded rows (dropping unsupervised ones) and counts them in the summary."""

    def __init__(self, summary: DataSummary) -> None:
        self.summary = summary
        self.file_index = {name: i for i, name in enumerate(summary.files)}
        self.ids: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self.files: list[int] = []
        self.lines: list[int] = []

    def add(self, row: RawRow, ids: list[int], mask: list[int], truncated: bool) -> None:
        self.summary.rows_truncated += int(truncated)
        supervised = sum(mask)
        if supervised == 0:
            self.summary.rows_without_supervision += 1
            return
        self.ids.append(torch.tensor(ids, dtype=torch.int32))
        self.masks.append(torch.tensor(mask, dtype=torch.uint8))
        self.lengths.append(len(ids))
        self.files.append(self.file_index[row.file])
        self.lines.append(row.line)
        self.summary.rows_kept += 1
        self.summary.tokens += len(ids)
        self.summary.supervised_tokens += supervised

    def tensors(self) -> tuple[torch.Tensor, ...]:
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.long)
        if self.lengths:
            offsets[1:] = torch.tensor(self.lengths, dtype=torch.long).cumsum(0)
        return (
            torch.cat(self.ids) if self.ids else torch.zeros(0, dtype=torch.int32),
            torch.cat(self.masks) if self.masks else torch.zeros(0, dtype=torch.uint8),
            offsets,
            torch.tensor(self.files, dtype=torch.int32),
            torch.tensor(self.lines, dtype=torch.int32),
        )


def _handle_bad(summary: DataSummary, error: DataRowError, on_bad_row: str) -> None:
    if on_bad_row == "raise":
        raise DataRowError(error.file, error.line, error.field, error.problem, hint=DataRowError.SKIP_HINT)
    summary.rows_bad_skipped += 1
    if len(summary.bad_row_examples) < MAX_BAD_ROW_EXAMPLES:
        summary.bad_row_examples.append(str(error))


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
