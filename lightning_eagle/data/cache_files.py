"""The files of a chat-data cache: the row file ``data.safetensors`` and the chunk files of an unfinished build.

``<cache>/<key>/data.safetensors`` is a standard safetensors file holding every kept row flat (``offsets`` int64
[N+1], ``input_ids`` int32, ``source_file`` / ``source_line`` int32 [N], ``loss_mask`` uint8), widest dtype first so
each tensor is aligned to its element size and :func:`map_safetensors` maps it in place. It is written by
:func:`write_rows_file` one tensor of one part at a time. ``<cache>/<key>/chunks/chunk_NNNNNN.safetensors``
(:class:`ChunkStore`) hold the encoded chunks of a build until the row file is written, so a killed run resumes with
its completed chunks. ``manifest.json`` (written last, by :mod:`lightning_eagle.data.dataset`) commits the cache.

The format strings are part of every cache on disk: a change to them makes existing caches unreadable (rebuilt).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lightning_eagle.atomic import atomic_file
from lightning_eagle.data.encoding import DataSummary
from lightning_eagle.errors import RunError

log = logging.getLogger(__name__)

# 3: supervision counted after the one-token shift; 4: the summary counts cuts at other max_lengths (data report);
# 5: the manifest holds the row file's sha256 and each chunk its tensors' (verified on every read)
CACHE_FORMAT = "lightning_eagle.chat_cache/5"
CHUNK_FORMAT = "lightning_eagle.chat_cache_chunk/4"

DATA_FILE = "data.safetensors"
MANIFEST_FILE = "manifest.json"
CHUNKS_DIR = "chunks"

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


class ChunkLostError(RunError):
    """A chunk of the build in progress disappeared (or changed) before the row file was written."""


class ChunkStore:
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
            if ok and tensors_sha256(safetensors_tensors(path)) != meta.get("sha256"):
                log.warning("recomputing chat-data chunk %s (its bytes do not match its checksum)", path)
                return False
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
            "sha256": tensors_sha256(tensors),
        }
        with atomic_file(self.path(index)) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        self.summaries[index] = summary

    def part(self, index: int) -> Callable[[str], torch.Tensor]:
        from safetensors import safe_open

        path = str(self.path(index))

        def get(name: str) -> torch.Tensor:
            try:
                with safe_open(path, "pt") as f:
                    return f.get_tensor(name)
            except Exception as exc:  # safetensors raises its own error for a missing or damaged file
                raise ChunkLostError(
                    f"chat-data chunk {path} was deleted or damaged while the cache was being built ({exc}); nothing "
                    "was committed: rerun to recover (the chunks still there are reused, this one is tokenized again)"
                ) from exc

        return get

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        try:
            self.directory.parent.rmdir()  # the key folder, when nothing else is in it
        except OSError:
            pass


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """One checksum over named tensors (names, dtypes, shapes and bytes, in name order)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def safetensors_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


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
