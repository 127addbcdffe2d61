"""Chooses the tests `make test-quick` leaves out, from a measured run of the whole suite.

    .venv/bin/python -m pytest -q -n auto --durations=0 --durations-min=0 > /tmp/durations.txt
    .venv/bin/python tests/mark_slow.py /tmp/durations.txt            # rewrites tests/slow_tests.txt

The quick set keeps every test module's cheapest test (so every module is touched), then the cheapest of
the rest while their summed time stays within --budget seconds of test time (two workers run it in about
half that, plus start-up); every other test is listed in tests/slow_tests.txt, which tests/conftest.py
marks `slow`. Times are a measurement of one machine, so the list is data to regenerate, not a verdict on
any test.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(tests/\S.*?)\s*$")
OUT = Path(__file__).with_name("slow_tests.txt")


def durations(text: str) -> dict[str, float]:
    """nodeid -> seconds (setup + call + teardown) from pytest's --durations report."""
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out[m.group(3)] += float(m.group(1))
    return dict(out)


def choose(times: dict[str, float], budget: float) -> tuple[list[str], float]:
    """(the slow node ids, sorted; the quick set's summed seconds)."""
    by_module = defaultdict(list)
    for node, t in times.items():
        by_module[node.split("::")[0]].append((t, node))
    quick = {min(tests)[1] for tests in by_module.values()}
    spent = sum(times[n] for n in quick)
    for t, node in sorted((t, n) for n, t in times.items() if n not in quick):
        if spent + t > budget:
            break
        quick.add(node)
        spent += t
    return sorted(n for n in times if n not in quick), spent


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("durations", help="the output of a whole-suite run with --durations=0 --durations-min=0")
    p.add_argument("--budget", type=float, default=330.0, help="seconds of test time in the quick set")
    args = p.parse_args(argv)
    times = durations(Path(args.durations).read_text())
    if not times:
        raise SystemExit(f"{args.durations}: no duration lines (run pytest with --durations=0 --durations-min=0)")
    slow, spent = choose(times, args.budget)
    header = (f"# tests `make test-quick` leaves out (tests/mark_slow.py from a measured run: {len(times)} tests, "
              f"{sum(times.values()):.0f} s of test time; the quick set {len(times) - len(slow)} tests, {spent:.0f} s)\n")
    OUT.write_text(header + "".join(f"{n}\n" for n in slow))
    print(header.strip())


if __name__ == "__main__":
    main()
