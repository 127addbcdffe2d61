"""favor.runtime's process settings change speed only: with the garbage collector's raised thresholds,
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
