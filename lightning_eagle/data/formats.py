"""Chat data formats and sources: ShareGPT, OpenAI chat messages and pre-tokenized rows, read from JSON / JSONL
(optionally ``.gz`` / ``.zst`` compressed) or Parquet files, single files, globs or directories of shards.

Every row is *normalized* on reading to what the rest of the pipeline understands (:mod:`lightning_eagle.data.rows`):
a conversation ``{"messages": [...], "tools": [...]?}`` with the roles ``system`` / ``user`` / ``assistant`` /
``tool`` (OpenAI-style, assistant ``tool_calls`` and ``reasoning_content`` rendered by the K3 template), or a
pre-tokenized row ``{"input_ids": [...], "loss_mask": [...]?}``.

Formats (``format=``; ``"auto"`` decides per file, from a Parquet file's columns or the first JSON object):

* ``sharegpt``: ``{"conversations": [{"from": "human", "value": "..."}, ...], "system"?: "...", "tools"?: [...]}``
  (also ``{"id": ..., "conversations": ...}`` and SpecForge's ``{"role", "content"}`` turns). Detected when the
  first object has ``conversations``.
* ``openai``: ``{"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?, "tool_call_id"?}],
  "tools"?}``; pre-tokenized rows may be mixed in (what this project always accepted). Detected when the first
  object has ``messages`` (and the fallback when it has none of the three keys).
* ``tokens``: ``{"input_ids": [...], "loss_mask": [...]?}`` only. Detected when the first object has ``input_ids``
  (and no ``messages``).

Role names (both chat formats, case-insensitive), :data:`ROLE_TABLE`:

* ``human``, ``user`` → ``user``
* ``gpt``, ``assistant``, ``chatgpt``, ``bing``, ``bard``, ``model`` → ``assistant``
* ``system``, ``developer`` → ``system``
* ``tool``, ``function``, ``observation`` → ``tool`` (the result of a tool call)
* ShareGPT only: ``function_call`` → an ``assistant`` turn whose value (a JSON ``{"name", "arguments"}`` object or
  a list of them) becomes its ``tool_calls``.

Any other role is a malformed row (``on_bad_row``): ``file:line: conversations[2].from: expected one of [...],
got str "bot"``. For Parquet the "line" is the 1-based row number in the file.
"""

from __future__ import annotations

import errno
import glob
import gzip
import io
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from lightning_eagle.data.rows import DataRowError, RawLine, RawRow, RowProblem, describe_value, iter_json_text
from lightning_eagle.data.zst_stream import ZstdFrames

FORMATS = ("auto", "sharegpt", "openai", "tokens")
RESOLVED_FORMATS = ("sharegpt", "openai", "tokens")

ROLE_TABLE: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
SHAREGPT_TOOL_CALL_ROLE = "function_call"

# Suffixes taken from directories and globs (an explicitly named file is read whatever its suffix: JSONL unless it
# ends in .json / .parquet, after stripping .gz / .zst).
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".parquet")
COMPRESSED_SUFFIXES = (".gz", ".zst")
PARQUET_BATCH_ROWS = 1024

# Columns read from Parquet files per format (others are not read at all).
_PARQUET_COLUMNS = {
    "sharegpt": ("conversations", "system", "tools"),
    "openai": ("messages", "tools", "input_ids", "loss_mask"),
    "tokens": ("input_ids", "loss_mask"),
}
_PRIMARY_KEY = {"sharegpt": "conversations", "openai": "messages", "tokens": "input_ids"}


@dataclass(frozen=True)
class Source:
    """One input file and the format its rows are read in (``sharegpt`` / ``openai`` / ``tokens``)."""

    path: str
    format: str


# --------------------------------------------------------------------------------------------- finding files


def _has_magic(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def is_supported_file(path: str | Path) -> bool:
    return str(path).lower().endswith(SUPPORTED_SUFFIXES)


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _broken_link(path: Path) -> str:
    """``path`` (a symlink that does not resolve) and why: a dangling target or a loop."""
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python 3.10-3.12 report a symlink loop this way
        return f"{str(path)!r} (a symlink loop)"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{str(path)!r} (a symlink loop)"
    return f"{str(path)!r} (a dangling symlink to {os.readlink(path)!r})"


def expand_paths(specs: Sequence[str | os.PathLike]) -> list[str]:
    """Files, globs (``data/*.jsonl``, ``data/**/*.parquet``) and directories (every supported file inside, recursive,
    hidden names skipped) → a list of files, each glob/directory sorted. Raises ``FileNotFoundError`` naming every
    spec that matches nothing."""
    files: list[str] = []
    missing: list[str] = []
    empty: list[str] = []
    unreadable: list[str] = []  # a shard that is listed or matched but cannot be opened is never skipped silently
    for spec in specs:
        spec = str(spec)
        path = Path(spec)
        if path.is_file():
            files.append(spec)
        elif path.is_dir():
            entries = [p for p in path.rglob("*") if is_supported_file(p) and not _hidden(p, path)]
            unreadable += [_broken_link(p) for p in entries if p.is_symlink() and not p.exists()]
            found = sorted(str(p) for p in entries if p.is_file())
            if not found and not unreadable:
                empty.append(f"directory {spec!r}")
            files += found
        elif _has_magic(spec):
            links = [Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_symlink() and not Path(p).exists()]
            unreadable += [_broken_link(p) for p in links if is_supported_file(p)]
            matched = sorted(p for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            found = [p for p in matched if is_supported_file(p)]
            if not found:
                note = f" (matched only unsupported files: {matched[:3]})" if matched else ""
                empty.append(f"glob {spec!r}{note}")
            files += found
        else:
            missing.append(spec)
    if unreadable:
        raise FileNotFoundError(f"chat data file(s) that cannot be read: {'; '.join(sorted(unreadable))}")
    if missing:
        raise FileNotFoundError(f"chat data file(s) not found: {missing}")
    if empty:
        raise FileNotFoundError(f"no chat data file ({', '.join(SUPPORTED_SUFFIXES)}) in {'; '.join(empty)}")
    return files


def _kind(path: str | Path) -> tuple[str, str | None]:
    """(``"jsonl"`` | ``"json"`` | ``"parquet"``, compression or None) from the file name."""
    name = str(path).lower()
    compression = None
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            compression, name = suffix[1:], name[: -len(suffix)]
            break
    if name.endswith(".parquet"):
        return "parquet", compression
    if name.endswith(".json"):
        return "json", compression
    return "jsonl", compression


# --------------------------------------------------------------------------------------------- reading records


def _open_binary(path: Path, compression: str | None) -> BinaryIO:
    if compression == "gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if compression == "zst":  # every frame; EOFError for a file cut inside one (like gzip's)
        return io.BufferedReader(ZstdFrames(path))  # type: ignore[return-value]
    return open(path, "rb")


def _decompress_error(name: str, line: int, exc: Exception) -> DataRowError:
    return DataRowError(name, line, "<file>", f"cannot read the compressed file ({type(exc).__name__}: {exc})")


def _decompression_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, EOFError, gzip.BadGzipFile]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover - zstandard is a dependency
        pass
    return tuple(errors)


# Two JSON values on one line joined by a CR: no JSON text holds that (a raw CR is whitespace between tokens, never
# inside a string), so it is a file whose rows end in CR alone.
_CR_ROWS = re.compile(rb"[}\]][ \t]*\r[ \t\r]*[{\[]")
CR_LINE_ENDS = (
    "the file uses CR (old Mac) line ends: JSONL rows end in LF (\\n), so its rows read as one line; convert the "
    "line ends (e.g. tr '\\r' '\\n' < old.jsonl > new.jsonl)"
)


def _iter_jsonl(path: Path, compression: str | None) -> Iterator[RawLine]:
    name = str(path)
    errors = _decompression_errors()
    line_no, offset = 0, 0
    with _open_binary(path, compression) as stream:
        lines = iter(stream)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except errors as exc:
                raise _decompress_error(name, line_no + 1, exc) from exc
            line_no += 1
            if b"\r" in raw and _CR_ROWS.search(raw):
                raise DataRowError(name, line_no, "<file>", CR_LINE_ENDS)
            # decoded once, from a view without the line end or a byte-order mark: a long line is not copied again
            start = 3 if line_no == 1 and raw.startswith(b"\xef\xbb\xbf") else 0
            end = len(raw)
            while end > start and raw[end - 1] in b"\r\n":  # column numbers in JSON errors count within the line
                end -= 1
            try:
                text = str(memoryview(raw)[start:end], "utf-8")
            except UnicodeDecodeError as exc:
                raise DataRowError(
                    name, line_no, "<file>", f"not UTF-8 text ({exc.reason} at byte {offset + start + exc.start})"
                ) from exc
            offset += len(raw)
            raw = b""
            if text and not text.isspace():
                yield RawLine(name, line_no, text)


def parse_line(item: RawLine) -> RawRow:
    """The parsed JSON of a JSONL line; raises :class:`RowProblem` (``<json>``) for invalid JSON."""
    try:
        return RawRow(item.file, item.line, json.loads(item.text))
    except json.JSONDecodeError as exc:
        raise RowProblem("<json>", f"invalid JSON: {exc.msg} at column {exc.colno}") from None


def _iter_json(path: Path, compression: str | None) -> Iterator[RawRow | DataRowError]:
    name = str(path)
    try:
        with _open_binary(path, compression) as stream:
            data = stream.read()
    except _decompression_errors() as exc:
        raise _decompress_error(name, 1, exc) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataRowError(name, 1, "<file>", f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    yield from iter_json_text(name, text.removeprefix("\ufeff"))


def _parquet_file(path: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise DataRowError(str(path), 1, "<file>", f"not a readable Parquet file ({exc})") from exc


def _iter_parquet(path: Path, fmt: str | None) -> Iterator[RawRow | DataRowError]:
    name = str(path)
    parquet = _parquet_file(path)
    names = parquet.schema_arrow.names
    columns = None
    if fmt is not None and _PRIMARY_KEY[fmt] in names:
        columns = [c for c in _PARQUET_COLUMNS[fmt] if c in names]
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            for record in batch.to_pylist():
                row += 1
                yield RawRow(name, row, record)
    except DataRowError:
        raise
    except Exception as exc:
        raise DataRowError(name, row + 1, "<file>", f"cannot read the Parquet file ({exc})") from exc


def iter_items(path: str | Path, fmt: str | None = None) -> Iterator[RawLine | RawRow | DataRowError]:
    """The rows of one file as they are stored: JSONL lines unparsed (:class:`RawLine`), JSON array elements and
    Parquet rows parsed (:class:`RawRow`, not normalized). ``fmt`` only selects Parquet columns."""
    path = Path(path)
    kind, compression = _kind(path)
    if kind == "parquet":
        if compression is not None:
            raise DataRowError(str(path), 1, "<file>", "a compressed Parquet file: Parquet compresses its own pages")
        return _iter_parquet(path, fmt)
    if kind == "json":
        return _iter_json(path, compression)
    return _iter_jsonl(path, compression)


# --------------------------------------------------------------------------------------------- detection


def format_of_row(data: Any) -> str | None:
    """The format a parsed row looks like, or None when it has none of the keys."""
    if not isinstance(data, dict):
        return None
    if "messages" in data:
        return "openai"
    if "conversations" in data:
        return "sharegpt"
    if "input_ids" in data:
        return "tokens"
    return None


def detect_format(path: str | Path) -> str:
    """``sharegpt`` / ``openai`` / ``tokens`` from a Parquet file's columns or the first JSON object of the file that
    has one of ``messages`` / ``conversations`` / ``input_ids`` (``openai`` when none has: its errors apply)."""
    path = Path(path)
    if _kind(path)[0] == "parquet":
        names = _parquet_file(path).schema_arrow.names
        for key, fmt in (("messages", "openai"), ("conversations", "sharegpt"), ("input_ids", "tokens")):
            if key in names:
                return fmt
        return "openai"
    records = iter_items(path)
    try:
        for item in records:
            if isinstance(item, RawLine):
                try:
                    item = parse_line(item)
                except (RowProblem, RecursionError):  # a bad row is the readers' to report (with its line)
                    continue
            if isinstance(item, RawRow):
                fmt = format_of_row(item.data)
                if fmt is not None:
                    return fmt
    except (DataRowError, RecursionError):
        pass  # an unreadable file is reported when its rows are read
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()
    return "openai"


def resolve_sources(specs: Sequence[str | os.PathLike], format: str = "auto") -> list[Source]:
    """Expand files/globs/directories and decide each file's format (``format="auto"``) or force one."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    files = expand_paths(specs)
    return [Source(f, detect_format(f) if format == "auto" else format) for f in files]


# --------------------------------------------------------------------------------------------- normalization


def map_role(role: Any) -> str | None:
    """The canonical role for a role name (:data:`ROLE_TABLE`, case-insensitive), or None."""
    if not isinstance(role, str):
        return None
    return ROLE_TABLE.get(role.strip().lower())


def _role_choices() -> str:
    return str([*ROLE_TABLE, SHAREGPT_TOOL_CALL_ROLE])


def _tools(value: Any) -> Any:
    """``tools`` as a list; a JSON string of a list (how Parquet / LLaMA-Factory files often store it) is parsed."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            problem = f"expected a list of tool objects or a JSON string of one, got invalid JSON ({exc.msg})"
            raise RowProblem("tools", problem) from None
    return value


def _without_nulls(message: dict[str, Any]) -> dict[str, Any]:
    """Drop optional keys whose value is null (Parquet structs carry every field); ``content`` stays."""
    if any(v is None for k, v in message.items() if k != "content"):
        return {k: v for k, v in message.items() if v is not None or k == "content"}
    return message


def _legacy_function_call(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's deprecated ``function_call`` on an assistant message → ``tool_calls``."""
    call = message.get("function_call")
    if isinstance(call, dict) and not message.get("tool_calls"):
        message = {k: v for k, v in message.items() if k != "function_call"}
        message["tool_calls"] = [{"type": "function", "function": call}]
    return message


def normalize_openai(data: Any) -> dict[str, Any]:
    """An OpenAI chat row with role aliases mapped, null fields dropped, legacy ``function_call`` → ``tool_calls``
    and a JSON-string ``tools`` parsed. Structural problems are left to :func:`~lightning_eagle.data.rows.validate_row`
    (unknown roles included: its message names the four canonical roles)."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        return data
    messages = []
    for message in data["messages"]:
        if isinstance(message, dict):
            message = _without_nulls(message)
            role = map_role(message.get("role"))
            if role is not None and role != message.get("role"):
                message = {**message, "role": role}
            if role == "assistant" and "function_call" in message:
                message = _legacy_function_call(message)
        messages.append(message)
    row = {**data, "messages": messages}
    if "tools" in row:
        row["tools"] = _tools(row["tools"])
    return row


def _sharegpt_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """A ShareGPT ``function_call`` value → OpenAI ``tool_calls``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            problem = f'expected a JSON {{"name", "arguments"}} object, got invalid JSON ({exc.msg})'
            raise RowProblem(where, problem) from None
    calls = value if isinstance(value, list) else [value]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise RowProblem(where, f'expected a {{"name", "arguments"}} object, got {describe_value(call)}')
        out.append({"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments")}})
    return out


def _first_present(turn: dict[str, Any], keys: Sequence[str]) -> str | None:
    for key in keys:
        if turn.get(key) is not None:
            return key
    for key in keys:
        if key in turn:
            return key
    return None


def normalize_sharegpt(data: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A ShareGPT row → ``({"messages": [...], "tools"?: [...]}, source field of each message)``.

    Raises :class:`RowProblem` naming the ShareGPT field (``conversations[2].from``) for a missing / unknown role or
    a non-string value."""
    if not isinstance(data, dict):
        raise RowProblem("<row>", f"expected a JSON object with 'conversations', got {describe_value(data)}")
    if "conversations" not in data:
        raise RowProblem(
            "conversations",
            f"expected a list of turns (ShareGPT), got a row with keys {sorted(data)} "
            "(pass format='openai' or 'tokens' if the file is not ShareGPT)",
        )
    turns = data["conversations"]
    if not isinstance(turns, list):
        raise RowProblem("conversations", f"expected a list of turns, got {describe_value(turns)}")
    if not turns:
        raise RowProblem("conversations", "expected a non-empty list of turns, got an empty list")
    messages: list[dict[str, Any]] = []
    fields: list[str] = []
    system = data.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise RowProblem("system", f"expected a string, got {describe_value(system)}")
        if system.strip():
            messages.append({"role": "system", "content": system})
            fields.append("system")
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise RowProblem(where, f"expected a turn object ({{from, value}}), got {describe_value(turn)}")
        role_key = _first_present(turn, ("from", "role"))
        if role_key is None:
            raise RowProblem(f"{where}.from", "expected a role name, got nothing (the field is missing)")
        raw_role = turn[role_key]
        text_key = _first_present(turn, ("value", "content")) or "value"
        value = turn.get(text_key)
        if isinstance(raw_role, str) and raw_role.strip().lower() == SHAREGPT_TOOL_CALL_ROLE:
            calls = _sharegpt_calls(value, f"{where}.{text_key}")
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
            fields.append(where)
            continue
        role = map_role(raw_role)
        if role is None:
            problem = f"expected one of {_role_choices()}, got {describe_value(raw_role)}"
            raise RowProblem(f"{where}.{role_key}", problem)
        message: dict[str, Any] = {"role": role, "content": value}
        for key in ("name", "reasoning_content", "reasoning", "tool_calls", "tool_call_id"):
            if turn.get(key) is not None:
                message[key] = turn[key]
        if not isinstance(value, str) and not (value is None and message.get("tool_calls")):
            if not (isinstance(value, list) and text_key == "content"):  # role/content turns may carry text parts
                got = "nothing (the field is missing)" if text_key not in turn else describe_value(value)
                raise RowProblem(f"{where}.{text_key}", f"expected a string, got {got}")
        messages.append(message)
        fields.append(where)
    row: dict[str, Any] = {"messages": messages}
    tools = _tools(data.get("tools"))
    if tools is not None:
        row["tools"] = tools
    return row, tuple(fields)


def normalize_tokens(data: Any) -> dict[str, Any]:
    if isinstance(data, dict) and "input_ids" in data and "messages" not in data:
        return data
    got = f"a row with keys {sorted(data)}" if isinstance(data, dict) else describe_value(data)
    raise RowProblem(
        "input_ids",
        f"expected a pre-tokenized row with 'input_ids' (format 'tokens'), got {got} "
        "(pass format='openai' for files that mix chat and pre-tokenized rows)",
    )


def normalize_row(row: RawRow, fmt: str) -> RawRow:
    """``row`` in the pipeline's shape (see the module docstring); raises :class:`RowProblem`."""
    if fmt == "sharegpt":
        data, fields = normalize_sharegpt(row.data)
        return RawRow(row.file, row.line, data, fields)
    if fmt == "tokens":
        return RawRow(row.file, row.line, normalize_tokens(row.data))
    return RawRow(row.file, row.line, normalize_openai(row.data))


_MESSAGE_FIELD = re.compile(r"^messages\[(\d+)\]")


def source_field(field: str, fields: Sequence[str] | None) -> str:
    """Rename ``messages[i]...`` to the field the message came from (``conversations[j]...``) when known."""
    if not fields:
        return field
    if field == "messages":
        return "conversations"
    match = _MESSAGE_FIELD.match(field)
    if match is None or int(match.group(1)) >= len(fields):
        return field
    return fields[int(match.group(1))] + field[match.end() :]


TOO_DEEP = "nested deeper than Python's recursion limit (a pathological or corrupted row)"


def prepare_row(item: RawLine | RawRow, fmt: str) -> RawRow:
    """Parse (a JSONL line) and normalize one stored row; raises :class:`RowProblem` (also for a row nested too
    deeply to parse, so ``on_bad_row: skip`` skips it like any malformed row)."""
    try:
        return normalize_row(parse_line(item) if isinstance(item, RawLine) else item, fmt)
    except RecursionError:
        raise RowProblem("<json>", TOO_DEEP) from None


def iter_source_rows(source: Source) -> Iterator[RawRow | DataRowError]:
    """Normalized rows of one source; a row that cannot be parsed or normalized is yielded as a
    :class:`DataRowError`."""
    for item in iter_items(source.path, source.format):
        if isinstance(item, DataRowError):
            yield item
            continue
        try:
            yield prepare_row(item, source.format)
        except RowProblem as exc:
            yield DataRowError(item.file, item.line, exc.field, exc.problem)


def iter_rows(
    specs: str | os.PathLike | Sequence[str | os.PathLike], format: str = "auto"
) -> Iterator[RawRow | DataRowError]:
    """Normalized rows (``{"messages": ...}`` or ``{"input_ids": ...}``) of files / globs / directories, in order, in
    any supported format (``format="auto"`` detects it per file).

    A JSONL line that is not valid JSON, or a row that cannot be normalized (a ShareGPT turn with an unknown role), is
    yielded as a :class:`DataRowError`; a file that cannot be read at all (not UTF-8, a ``.json`` file that does not
    parse, a broken compressed stream) raises one (its rows cannot be told apart)."""
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    for source in resolve_sources(specs, format):
        yield from iter_source_rows(source)
