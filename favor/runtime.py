"""Process-level settings for running favor on a host CPU.

XLA:CPU allocates each program's outputs and temporaries afresh on every call. glibc's malloc hands
blocks of 32 MiB and more straight to mmap and returns them with munmap on free, so every call of a
long-sequence program page-faults (and the kernel zeroes) all of its large buffers again: an
elementwise op over a [4, 8192, 256] float32 array costs about 4× as much that way as with the pages
kept (BENCHMARKS.md, design-measurements). Raising malloc's mmap and trim
thresholds keeps freed pages in the heap for reuse. It changes speed only, never results, and the
benchmark applies it to every kind alike, exact softmax and the matmul yardstick included.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1   # mallopt parameter numbers from glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30    # blocks up to 1 GiB come from the heap; freed memory up to 2 GiB stays mapped

_applied = None


def keep_host_pages() -> bool:
    """Apply the malloc thresholds once per process. Returns whether they are in effect (False on
    platforms without glibc's mallopt, where nothing changes)."""
    global _applied
    if _applied is None:
        _applied = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(
                    libc.mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP_BYTES))
            except (OSError, AttributeError):   # not glibc (musl, macOS): leave malloc alone
                _applied = False
    return _applied
