"""Atomic writes: a file or folder appears under its final name complete, or not at all (also after ``kill -9``).

Each write goes to a hidden sibling (same filesystem, so the final ``os.replace`` is an atomic rename), is flushed
to disk with ``fsync`` (data, then the parent folder's entry), and only then takes the final name. Temporary names
start with ``.`` and end in ``.partial``; a crashed writer's leftovers are removed by the next write of the same
name. Permissions follow the umask like any ``open()``: ``tempfile`` would make them private (0600/0700), and a
serving process running as another user must be able to read an export.

A write the operating system refuses (no space, a file-size limit, a read-only or foreign folder) raises
:class:`~lightning_eagle.errors.OutputWriteError` naming the file and the cause, with the original error chained;
serializers that hide the cause (``torch.save`` reports only a stream position) are explained from the limits.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from lightning_eagle.errors import OutputWriteError

PARTIAL_SUFFIX = ".partial"
# why the operating system refuses a write, in the words a user acts on
WRITE_REFUSALS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file is larger than this process may write (the file-size limit, ulimit -f)",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied (the folder is not writable by this user)",
    errno.EPERM: "operation not permitted (the folder is not writable by this user)",
}
LOW_SPACE_BYTES = 1 << 20


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


def write_refusal(exc: BaseException, folder: Path, written: Path | None = None) -> str | None:
    """Why the operating system refused a write into ``folder`` that raised ``exc``, or None (not an OS refusal).

    ``written`` is the partial output: ``torch.save`` reports a full disk or the file-size limit only as a stream
    position mismatch, so its size is compared with ``RLIMIT_FSIZE`` and the folder's free space is looked at.
    """
    if not isinstance(exc, Exception):
        return None
    if isinstance(exc, OSError) and exc.errno in WRITE_REFUSALS:
        return WRITE_REFUSALS[exc.errno]
    for code, reason in WRITE_REFUSALS.items():  # serializers that wrap the OS error keep its text
        if os.strerror(code) in str(exc):
            return reason
    if not isinstance(exc, (OSError, RuntimeError)):
        return None
    limit, largest = resource.getrlimit(resource.RLIMIT_FSIZE)[0], _largest_file(written)
    if limit != resource.RLIM_INFINITY and largest and largest >= limit - 4096:
        return WRITE_REFUSALS[errno.EFBIG]
    with contextlib.suppress(OSError):
        if shutil.disk_usage(folder).free < LOW_SPACE_BYTES:
            return WRITE_REFUSALS[errno.ENOSPC]
    return None


def _largest_file(written: Path | None) -> int:
    """Bytes of the largest file of a partial output (a file or a folder); 0 when there is none."""
    if written is None or not written.exists():
        return 0
    files = [written] if written.is_file() else [p for p in written.rglob("*") if p.is_file()]
    return max((p.stat().st_size for p in files), default=0)


@contextlib.contextmanager
def explained_write(final: Path, partial: Path, cleanup: Callable[[], None]) -> Iterator[None]:
    """On a failure inside the block: explain it (an OS refusal becomes one :class:`OutputWriteError` naming
    ``final`` and the cause), then ``cleanup()`` the partial output; a cleanup's own error never hides the cause."""
    try:
        yield
    except BaseException as exc:
        folder = next((p for p in final.parents if p.exists()), Path.cwd())
        reason = write_refusal(exc, folder, partial)
        with contextlib.suppress(OSError):
            cleanup()
        if reason is None:
            raise
        raise OutputWriteError(f"cannot write {final}: {reason} ({exc}); nothing was written under that name") from exc


def _partial_name(final: Path) -> Path:
    return final.parent / f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it becomes ``path`` (replacing any old file)."""
    final = Path(path)
    tmp = _partial_name(final)
    with explained_write(final, tmp, cleanup=lambda: tmp.unlink(missing_ok=True)):
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_partials(final.parent, final.name)
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        fsync_tree(tmp)
        os.replace(tmp, final)
        _fsync_dir(final.parent)


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
    tmp = _partial_name(final)
    with explained_write(final, tmp, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True)):
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_partials(final.parent, final.name)
        tmp.mkdir(mode=0o777 & ~_umask())
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


def check_writable(folder: str | os.PathLike, what: str) -> None:
    """Refuse, before any work, an output ``folder`` this process cannot create or write into: a file in its place,
    a read-only file system, no permission, a full disk (whether the free space suffices is the writer's to say: the
    dump checks its total). Probes the folder itself, or the nearest existing ancestor
    when it is still to be created (nothing is created by the check)."""
    folder = Path(folder).absolute()
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    if not existing.is_dir():
        raise OutputWriteError(f"{what} {folder} cannot be created: {existing} exists and is not a folder")
    probe = existing / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
    except OSError as exc:
        reason = write_refusal(exc, existing) or exc.strerror or str(exc)
        target = "write into" if existing == folder else f"create it ({existing} refuses new entries)"
        raise OutputWriteError(f"{what} {folder}: cannot {target}: {reason}") from exc
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
