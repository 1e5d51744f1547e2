"""One builder per chat-data cache key: an exclusive ``flock`` on ``<cache>/<key>/build.lock``.

``prepare_data`` runs on local rank 0 of every node, and nodes may share the cache folder: two processes building one
key at once deleted each other's chunks while the other still read them, or unlinked the winner's manifest and left
the cache uncommitted. :func:`cache_build_lock` lets one process build; the others wait, then read what it committed
(the caller loads again under the lock). The kernel drops the lock when its holder dies (``kill -9`` included), so a
killed build never leaves the key stuck, and the next holder resumes from its finished chunks.

The lock file is removed when the build ends (a failed build leaves no folder behind, as before): a waiter that then
gets the lock checks that its file is still the one at the path, else it locks the new one. Where the file system
refuses locks the build goes on unlocked, with a warning.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning_eagle.atomic import write_refusal
from lightning_eagle.errors import OutputWriteError

log = logging.getLogger(__name__)

LOCK_FILE = "build.lock"


@contextmanager
def cache_build_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold the build claim on the cache folder of one key (waiting while another process holds it); on exit the
    lock file is removed, and so are ``folder`` and the folders made for it when they are empty."""
    folder = Path(folder)
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    path = folder / LOCK_FILE
    fd = _acquire(path)
    try:
        yield
    finally:
        if fd is not None:
            path.unlink(missing_ok=True)  # before the lock is dropped: a waiter then sees its file is gone
            os.close(fd)
        for empty in [folder, *created[1:]]:
            try:
                empty.rmdir()  # only when empty: a failed build leaves nothing, a committed one its files
            except OSError:
                break


def _acquire(path: Path) -> int | None:
    waited = False
    for attempt in range(1000):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:  # a failed build removed the folder meanwhile: make it again
            if attempt < 999:
                continue
            raise
        except OSError as exc:
            folder = next((p for p in path.parents if p.exists()), Path.cwd())
            reason = write_refusal(exc, folder) or exc.strerror or str(exc)
            raise OutputWriteError(
                f"cannot build the tokenized-data cache in {path.parent}: {reason}; choose a writable "
                "data.cache_dir (or set data.use_cache false)"
            ) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waited:
                    log.warning(
                        "chat data: waiting for %s to finish building the tokenized-data cache %s",
                        _holder(fd),
                        path.parent,
                    )
                waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # a file system without locks (some network mounts)
            os.close(fd)
            log.warning(
                "chat data: cannot lock %s (%s): building the cache unlocked; two processes building it at once "
                "would race (give each node its own data.cache_dir)",
                path,
                exc,
            )
            return None
        try:
            current = os.stat(path)
            mine = os.fstat(fd)
            same = (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
            return fd
        os.close(fd)  # the previous holder removed the file we locked: lock the one at the path now
    raise RuntimeError(f"could not take the build lock {path}: its file kept being replaced")


def _holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode(errors="replace"))
        return f"pid {holder['pid']} on {holder['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"
