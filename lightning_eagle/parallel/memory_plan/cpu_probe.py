"""Peak resident memory of one phase of a CPU process (Linux): how the plan is held against what a machine really had
to provide (``benchmarks/long_context.py`` and the measured plan tests).

Run the process with :data:`MALLOC_ENV` so that glibc serves every block of 64 KiB or more from ``mmap`` and returns
it on free (freed tensors then leave the RSS at once). A phase's peak is ``peak() − rss()`` taken before it, after
``reset_peak()``: ``/proc/self/clear_refs`` ← 5 resets the kernel's high-water mark ``VmHWM`` to the current RSS.
RSS counts touched 4 KiB pages, so a few MB of Python and allocator bookkeeping land in every measurement.
"""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def rss() -> int:
    """Resident bytes now, after a garbage collection and ``malloc_trim`` (what is still referenced)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Reset the high-water mark to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def peak() -> int:
    """The RSS high-water mark since the last :func:`reset_peak` (bytes)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024
