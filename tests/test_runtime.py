"""favor.runtime's process settings: XLA:CPU's scheduler flag set on import; with the garbage collector's raised thresholds,
reference cycles are still freed without an explicit collection."""

import gc
import weakref

from favor import runtime


class Node:
    """One end of a reference cycle, weakly referable so the test can see whether it was freed."""
    __slots__ = ("other", "__weakref__")


def test_raised_thresholds_still_free_reference_cycles():
    before = gc.get_threshold()
    try:
        runtime.collect_less()
        assert gc.get_threshold() == runtime.GC_THRESHOLDS
        assert runtime.GC_THRESHOLDS[0] <= 100_000      # young garbage stays a fraction of one trace's objects
        gc.collect()
        alive = []
        for _ in range(20 * runtime.GC_THRESHOLDS[0]):      # many times the youngest generation's threshold
            a, b = Node(), Node()
            a.other, b.other = b, a                          # a cycle: reference counting alone never frees it
            alive.append(weakref.ref(a))
        left = sum(r() is not None for r in alive)
        # only the cycles made since the last automatic collection can be left
        assert left <= 2 * runtime.GC_THRESHOLDS[0], left
    finally:
        gc.set_threshold(*before)


def test_importing_favor_turns_off_the_cpu_scheduler_that_deadlocks_lapack_calls():
    """`import favor` adds --xla_cpu_enable_concurrency_optimized_scheduler=false to XLA_FLAGS (before JAX
    starts its CPU backend, so it applies), keeping the other flags and a value the user set."""
    import os
    import subprocess
    import sys

    def flags_after_import(flags):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        if flags is not None:
            env["XLA_FLAGS"] = flags
        code = "import favor, os, jax; jax.numpy.ones(1).block_until_ready(); print(os.environ['XLA_FLAGS'])"
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert flags_after_import(None) == "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    assert flags_after_import("--xla_cpu_use_fusion_emitters=false") == (
        "--xla_cpu_use_fusion_emitters=false --xla_cpu_enable_concurrency_optimized_scheduler=false")
    mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    assert flags_after_import(mine) == mine
