"""Process-level settings: XLA:CPU's scheduler, malloc on a host CPU, and Python's garbage collector while
JAX traces.

XLA:CPU's concurrency-optimised scheduler runs independent operations of a program side by side, and
LAPACK custom calls (jnp.linalg.eigh, inv) running side by side can wait on the same intra-op thread
pool forever: a training step of a 2-layer FAVOR# (SDERF) decoder with LoRA adapters, whose layers fit
their features to running statistics with independent eigh/inv calls, hung at its first step in every
try on this 2-core machine (all XLA threads parked, no CPU used), and ran with the scheduler off.
`cpu_scheduler()` turns it off through XLA_FLAGS when favor is imported (before JAX starts its CPU
backend), unless the flag is already set; it measured 2-5 % slower steps on the decoders it was tried
on, and about a fifth slower for FAVOR+'s causal forward and backward pass at L = 8192 (BENCHMARKS.md,
cpu-scheduler-on/off). CPU only: the flag does not touch accelerators.

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
import gc
import os
import sys

_M_TRIM_THRESHOLD = -1   # mallopt parameter numbers from glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30    # blocks up to 1 GiB come from the heap; freed memory up to 2 GiB stays mapped

_applied = None
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def cpu_scheduler() -> None:
    """Add `CPU_SCHEDULER_FLAG=false` to XLA_FLAGS unless the flag is there (a user's value is kept).
    Takes effect only if JAX has not yet started its CPU backend in this process."""
    flags = os.environ.get("XLA_FLAGS", "")
    if CPU_SCHEDULER_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}=false".strip()


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


# Tracing and lowering a model allocate many short-lived objects in reference cycles (tracers, jaxpr
# equations, MLIR handles): at the default youngest-generation threshold (700 net allocations up to
# Python 3.13) a run collects about a thousand times before its first step, scanning the same young
# objects again and again. At 20,000 the collections are dozens of times fewer and the garbage is the
# same: cycles are still freed, only in larger batches. The older generations keep the default ratios
# (10 and 10), so a full collection still follows every hundred young ones. The CPU time this saves is
# in BENCHMARKS.md (design-measurements).
GC_THRESHOLDS = (20_000, 10, 10)


def collect_less() -> None:
    """Set the garbage collector's thresholds to GC_THRESHOLDS for this process (results unchanged)."""
    gc.set_threshold(*GC_THRESHOLDS)
