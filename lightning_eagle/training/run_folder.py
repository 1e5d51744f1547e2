"""A fit's output folders, claimed before any work: every one writable, and no second live run writing into them.

Two fits into one folder would replace each other's checkpoints and export without a word, and a folder that cannot
be written is otherwise found at the first save, after the training it was meant to keep. A run claims every folder it
writes into: ``trainer.default_root_dir``, each ``ModelCheckpoint.dirpath`` and the export's ``out_dir``. The root is
claimed by ``<root>/.lightning_eagle.lock``, whose record lists the run's folders under it (nothing is created for them
before the run starts); a folder outside the root by ``<parent>/.lightning_eagle.lock.<name>`` beside it (the export
replaces its whole folder, so nothing of the claim lives inside). A run is refused when any of its folders is another
live run's root, another live run's outside folder, or listed by a live claim on one of its parents.

A claim is an advisory ``flock`` on ``<folder>/.lightning_eagle.lock``: the kernel drops it when its process ends, so
a run killed with ``kill -9`` never leaves the folder stuck. Only global rank 0 claims (the ranks of one run share
it). A file system without ``flock`` (NFS without lockd: ``ENOLCK``, ``EOPNOTSUPP``) is refused by name, unless
``LIGHTNING_EAGLE_RUN_LOCK=file`` asks for the fallback: an exclusive lock file (``.lightning_eagle.claim`` in place of
``.lightning_eagle.lock``) created with ``O_EXCL``, holding the run's pid and host, removed when the run ends. A
claim file left by a process that is gone on this host is taken over; one left by another host is kept (its process
cannot be checked from here): the message names the file to remove once that run is known to be dead.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_eagle.atomic import check_writable
from lightning_eagle.errors import RunError

LOCK_NAME = ".lightning_eagle.lock"
CLAIM_NAME = ".lightning_eagle.claim"  # the O_EXCL fallback of LOCK_MODE_ENV=file
LOCK_MODE_ENV = "LIGHTNING_EAGLE_RUN_LOCK"  # "flock" (default) or "file"
LOCK_MODES = ("flock", "file")
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
ROOT = "trainer.default_root_dir"


class FolderInUseError(RunError):
    """Another live run holds the output folder."""


class FolderLockError(RunError):
    """The folder cannot be claimed at all: no ``flock`` on its file system, or something else at the claim's path."""


def lock_mode() -> str:
    mode = os.environ.get(LOCK_MODE_ENV, "").strip() or "flock"
    if mode not in LOCK_MODES:
        raise FolderLockError(f"{LOCK_MODE_ENV}={mode!r}: expected one of {', '.join(LOCK_MODES)}")
    return mode


def lock_name() -> str:
    """The name of a root's claim file in the current :func:`lock_mode`."""
    return LOCK_NAME if lock_mode() == "flock" else CLAIM_NAME


def beside(folder: Path) -> Path:
    """The claim file of a folder outside its run's root: next to it, in its parent."""
    return folder.parent / f"{lock_name()}.{folder.name}"


def _open_claim(path: Path, flags: int) -> int:
    """``os.open`` of the claim's file, never through a symbolic link; what is there instead is named."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if path.is_symlink():
            target = os.readlink(path)
            state = "which does not exist" if not path.exists() else "a link is not a claim file"
            raise FolderLockError(
                f"the run's claim file {path} is a symbolic link (to {target}, {state}): remove it, the claim is a "
                "plain file this library writes"
            ) from None
        if path.is_dir():
            raise FolderLockError(
                f"the run's claim file {path} is a folder: remove it (or choose another folder), the claim is a plain "
                "file this library writes"
            ) from None
        if isinstance(exc, FileExistsError):
            raise
        raise FolderLockError(f"cannot open the run's claim file {path}: {exc.strerror or exc}") from None


def _no_flock(folder: Path, exc: OSError) -> FolderLockError:
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    return FolderLockError(
        f"{folder}: its file system does not support flock ({name}: {os.strerror(exc.errno)}; e.g. NFS without "
        "lockd), so this run cannot keep a second run out of the folder: use a folder on a local file system, or set "
        f"{LOCK_MODE_ENV}=file to claim it with an exclusive lock file ({CLAIM_NAME}: pid and host, removed when the "
        "run ends)"
    )


def _record(folders: list[str]) -> bytes:
    return json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "folders": folders}
    ).encode()


def _parse(text: str) -> dict:
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def _stale(holder: dict) -> bool:
    """A claim file whose process is gone from this host (one from another host cannot be checked)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _in_use(folder: Path, what: str, holder: str, claim: Path | None = None, claim_file: Path | None = None) -> str:
    at = f", its claim {claim}" if claim is not None and claim.parent != folder else ""
    choice = what if what == ROOT else f"folder for {what}"
    gone = f"; if that run is gone, remove {claim_file}" if claim_file is not None else ""
    return (
        f"{folder} is in use by a live run ({describe_holder(holder)}{at}): two runs into one folder would replace "
        f"each other's checkpoints and export; wait for it to end or choose another {choice}{gone}"
    )


class FolderLock:
    """An exclusive claim on ``folder`` (``folders``: the run's folders its record lists, ``what``: the folder's name
    in messages), released when the holder exits (``flock``) or ends the run (the lock-file fallback)."""

    def __init__(
        self, folder: str | os.PathLike, folders: list[str] | None = None, what: str = ROOT, path: Path | None = None
    ) -> None:
        self.folder, self.what, self.mode = Path(folder), what, lock_mode()
        self.folders = folders if folders is not None else [os.path.realpath(folder)]
        self.path = path if path is not None else self.folder / lock_name()
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.mode == "file":
            self._acquire_file()
            return
        fd = _open_claim(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip()
            os.close(fd)
            raise FolderInUseError(_in_use(self.folder, self.what, holder)) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno in _NO_FLOCK:
                raise _no_flock(self.folder, exc) from None
            raise FolderLockError(f"cannot lock the run's claim file {self.path}: {exc.strerror or exc}") from None
        os.ftruncate(fd, 0)
        os.write(fd, _record(self.folders))
        self._fd = fd

    def _acquire_file(self) -> None:
        for attempt in range(2):
            try:
                fd = _open_claim(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                holder = _read(self.path)
                if attempt == 0 and _stale(_parse(holder)):
                    self.path.unlink(missing_ok=True)  # its process is gone: the claim is taken over
                    continue
                raise FolderInUseError(_in_use(self.folder, self.what, holder, claim_file=self.path)) from None
            try:
                os.write(fd, _record(self.folders))
            finally:
                os.close(fd)
            self._created = True
            return

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (removing it would race a new claimant)
            self._fd = None
        if self._created:
            if _parse(_read(self.path)).get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self._created = False


def _read(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        return os.read(fd, 65536).decode(errors="replace").strip()
    finally:
        os.close(fd)


def live_claim(path: Path) -> str | None:
    """The record in the claim file ``path`` when a live run holds it (None: unclaimed). Creates nothing."""
    if lock_mode() == "file":
        holder = _read(path)
        return holder if path.is_file() and not _stale(_parse(holder)) else None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None  # no claim file (or not one this library wrote): unclaimed
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 65536).decode(errors="replace").strip()
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            raise _no_flock(path.parent, exc) from None
        return None
    finally:
        os.close(fd)  # drops the shared probe lock too
    return None


class RunClaim:
    """The claim of every folder one run writes into (``folders``: name → folder; ``trainer.default_root_dir``
    first)."""

    def __init__(self, folders: dict[str, str | os.PathLike]) -> None:
        self.folders: dict[Path, str] = {}
        for what, folder in folders.items():
            self.folders.setdefault(Path(os.path.realpath(folder)), what)
        root = next(iter(self.folders))
        self.claims = {root: root / lock_name()}  # folder -> the claim file this run holds for it
        self.claims |= {f: beside(f) for f in self.folders if f != root and root not in f.parents}
        self._locks: list[FolderLock] = []

    def acquire(self) -> None:
        listed = [str(f) for f in self.folders]
        try:
            for folder, path in self.claims.items():
                lock = FolderLock(folder, listed, self.folders[folder], path)
                lock.acquire()
                self._locks.append(lock)
            own = set(self.claims.values())
            for folder, what in self.folders.items():
                # another run's root, another run's outside folder (always in use); a parent's claim listing it
                places = [(folder / lock_name(), True), (beside(folder), True)]
                places += [(parent / lock_name(), False) for parent in folder.parents]
                for path, direct in places:
                    holder = None if path in own else live_claim(path)
                    if holder is not None and (direct or str(folder) in _parse(holder).get("folders", ())):
                        raise FolderInUseError(_in_use(folder, what, holder, claim=path))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []


def output_folders(trainer: pl.Trainer, export_parent: bool = False) -> dict[str, Path]:
    """The folders a fit writes into and claims, by the name a user knows them under: the root, each checkpoint
    folder, each export folder (``export_parent``: the folder it is created in, what must be writable)."""
    folders = {ROOT: Path(trainer.default_root_dir)}
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            folders[f"the checkpoint folder ({type(callback).__name__}.dirpath)"] = Path(callback.dirpath)
        resolved = getattr(callback, "resolved_out_dir", None)
        if callable(resolved):
            where = "the export folder's parent" if export_parent else "the export folder"
            folder = resolved(trainer)
            folders[f"{where} ({type(callback).__name__}.out_dir)"] = folder.parent if export_parent else folder
    return folders


class RunFolderGuard(pl.Callback):
    """At the start of ``fit`` (before the target loads): every output folder writable, every one claimed."""

    def __init__(self) -> None:
        self._lock: RunClaim | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        for what, folder in output_folders(trainer, export_parent=True).items():
            check_writable(folder, what)
        self._lock = RunClaim(output_folders(trainer))
        self._lock.acquire()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release()  # a failed fit in a notebook must not lock out the next one in the same process

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
