"""Peak resident memory of one phase of a CPU process (Linux): how the plan is held against what a machine really had
to provide (``benchmarks/long_context.py`` and the measured plan tests).

Run the process with :data:`PROBE_ENV`: glibc then serves every block of 64 KiB or more from ``mmap`` and returns it
on free (freed tensors leave the RSS at once), and oneDNN is capped at AVX-512 without its bf16/AMX kernels. Where a
CPU has AVX512-BF16 or AMX, oneDNN's bf16 kernels hold buffers of their own (measured: 242.6 MB instead of 133-135 MB
for the MEDIUM target's token-chunked forward on an AMD EPYC with AVX512-BF16): a CPU library's, not a tensor of the
plan, and absent on CPUs without those ISAs. Capped, the probe measures the same bytes on every x86 CPU (a cap above
what a CPU has changes nothing there). A phase's peak is ``peak() − rss()`` taken before it, after
``reset_peak()``: ``/proc/self/clear_refs`` ← 5 resets the kernel's high-water mark ``VmHWM`` to the current RSS.
RSS counts touched 4 KiB pages, so a few MB of Python and allocator bookkeeping land in every measurement.
"""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}


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
