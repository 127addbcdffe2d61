"""The quick set `make test-quick` runs (tests/mark_slow.py): every module's cheapest test, then the cheapest
others within the budget; the rest listed slow and marked so by conftest."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mark_slow  # noqa: E402

REPORT = """
============================= slowest durations ==============================
70.50s call     tests/test_a.py::test_big
9.00s call     tests/test_a.py::test_mid[x y]
1.00s setup    tests/test_a.py::test_mid[x y]
0.50s call     tests/test_a.py::test_small
40.00s call     tests/test_b.py::test_only
3.00s call     tests/test_c.py::test_one
2.00s teardown tests/test_c.py::test_one
"""


def test_durations_sum_the_phases_of_each_test():
    got = mark_slow.durations(REPORT)
    assert got == {"tests/test_a.py::test_big": 70.5, "tests/test_a.py::test_mid[x y]": 10.0,
                   "tests/test_a.py::test_small": 0.5, "tests/test_b.py::test_only": 40.0,
                   "tests/test_c.py::test_one": 5.0}


def test_every_module_keeps_its_cheapest_test_and_the_rest_fits_the_budget():
    times = mark_slow.durations(REPORT)
    slow, spent = mark_slow.choose(times, budget=50.0)
    # test_b's only test is its cheapest, kept though it alone is 40 s; then nothing else fits 50 s
    assert slow == ["tests/test_a.py::test_big", "tests/test_a.py::test_mid[x y]"] and spent == 45.5
    slow, spent = mark_slow.choose(times, budget=60.0)
    assert slow == ["tests/test_a.py::test_big"] and spent == 55.5


def test_the_listed_tests_are_marked_slow(request):
    import conftest
    listed = conftest.SLOW
    assert all(n.startswith("tests/") and "::" in n for n in listed)
    mine = request.node
    assert (mine.get_closest_marker("slow") is not None) == (mine.nodeid in listed)
