"""`python -m favor.bench headline`: rewrites the headline of BENCHMARKS.md (favor.bench.sections) from the
sections' raw figures, measuring nothing; every other subcommand refreshes it when it publishes."""

from __future__ import annotations

from pathlib import Path

from favor.bench import sections


def add_parser(sub):
    h = sub.add_parser("headline", help="regenerate BENCHMARKS.md's table of targets from bench/*.json")
    h.add_argument("--out", default=".")


def main(args, flags, argv, parser):
    if not (Path(args.out) / "BENCHMARKS.md").exists():
        parser.error(f"--out {args.out}: no BENCHMARKS.md there")
    sections.refresh_headline(args.out)
    print(sections.headline(args.out))
    return 0
