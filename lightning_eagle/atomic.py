"""Atomic writes: a file or folder appears under its final name complete, or not at all (also after ``kill -9``).

Each write goes to a hidden sibling (same filesystem, so the final ``os.replace`` is an atomic rename), is flushed
to disk with ``fsync`` (data, then the parent folder's entry), and only then takes the final name. Temporary names
start with ``.`` and end in ``.partial``; a crashed writer's leftovers are removed by the next write of the same
name. Permissions follow the umask like any ``open()``: ``tempfile`` would make them private (0600/0700), and a
serving process running as another user must be able to read an export.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

PARTIAL_SUFFIX = ".partial"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """``fsync`` a file, or every file and folder under ``path``."""
    for p in [path] if path.is_file() else [*path.rglob("*"), path]:
        _fsync(p)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse a directory fsync; the rename is still atomic
        _fsync(path)


def remove_partials(folder: Path, name: str = "*") -> None:
    """Delete the temporaries a killed writer left in ``folder`` (of final name ``name``; all by default)."""
    for stale in Path(folder).glob(f".{name}.*{PARTIAL_SUFFIX}"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _partial_name(final: Path) -> Path:
    return final.parent / f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it becomes ``path`` (replacing any old file)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_partials(final.parent, final.name)
    tmp = _partial_name(final)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        fsync_tree(tmp)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def weights_folder_problem(folder: Path, architectures: frozenset[str]) -> str | None:
    """Why ``folder`` is not a previous write of a weights folder (``config.json`` naming one of ``architectures`` +
    safetensors files, nothing else), or None: the one rule :func:`atomic_dir` callers use to decide what
    ``overwrite`` may delete (a run folder with checkpoints, or a user's files, never qualifies)."""
    entries = sorted(p.name for p in folder.iterdir())
    if not entries:
        return None

    def ours(name: str) -> bool:
        written = name == "config.json" or name.endswith((".safetensors", ".safetensors.index.json"))
        return written and not (folder / name).is_dir()

    others = [name for name in entries if not ours(name)]
    if others:
        return f"it holds other files ({', '.join(others[:5])}{', …' if len(others) > 5 else ''})"
    try:
        found = json.loads((folder / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return "it has no readable config.json of a previous write"
    if not isinstance(found, list) or not set(found) & architectures:
        return f"its config.json names architectures {found!r}, not one of {sorted(architectures)}"
    return None


@contextlib.contextmanager
def atomic_dir(
    path: str | os.PathLike, overwrite: bool = False, replaceable: Callable[[Path], str | None] | None = None
) -> Iterator[Path]:
    """Yield an empty temporary folder to fill; on success it becomes ``path``.

    With ``overwrite`` an existing folder is moved aside first and deleted after the swap, so a crash leaves either
    the old folder or the new one under ``path`` (never neither, never a mix). Only what the writer owns is ever
    replaced: ``replaceable(folder)`` returns why the existing folder is not a previous write of the same kind (e.g.
    :func:`weights_folder_problem`), and then nothing is touched; without ``replaceable`` nothing is replaced.
    """
    final = Path(path)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} exists; pass --overwrite (overwrite=True) to replace a previous write there")
    if final.exists():
        if not final.is_dir():
            problem = "it is a file, not a folder"
        else:
            problem = "this writer declares nothing it may replace" if replaceable is None else replaceable(final)
        if problem:
            raise FileExistsError(
                f"refusing to replace {final}: {problem}. --overwrite (overwrite=True) only replaces a previous write "
                "of the same kind; choose another folder"
            )
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_partials(final.parent, final.name)
    tmp = _partial_name(final)
    tmp.mkdir(mode=0o777 & ~_umask())
    try:
        yield tmp
        for p in tmp.rglob("*"):
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~_umask())
        fsync_tree(tmp)
        if final.exists():
            old = _partial_name(final)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
