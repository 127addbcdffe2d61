"""`python -m favor.repro list` and `python -m favor.repro <name> [--quick] [--out DIR] [options]`."""

from __future__ import annotations

import argparse
import os
import sys
import time

from favor import repro
from favor.repro import report, trained


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    names = repro.names()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nreproductions: " + ", ".join(names))
        return 0
    if argv[0] == "list":
        for name in names:
            print(f"{name:22s} {repro.get(name).SUMMARY}")
        return 0
    name = argv[0]
    if name not in names:
        print(f"error: unknown reproduction {name!r}; valid: list, {', '.join(names)}", file=sys.stderr)
        return 2
    module = repro.get(name)
    parser = argparse.ArgumentParser(prog=f"python -m favor.repro {name}", description=module.PROTOCOL,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a reduced protocol that runs in seconds (smaller sets, fewer seeds)")
    parser.add_argument("--out", default=None,
                        help=f"output directory (default: repro/{name}, where the committed outputs are; with "
                             "--quick a new temporary directory, so a smoke run never replaces them)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every draw and sample (default: %(default)s)")
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    temporary = args.out is None and args.quick
    args.out = report.resolve_out(args.out, name, args.quick)
    t0 = time.perf_counter()
    try:
        result = module.run(args)
    except (ValueError, FileNotFoundError, trained.SweepError) as e:
        print(f"error: {e}", file=sys.stderr)
        if temporary and not os.listdir(args.out):     # refused before writing: no empty directory left behind
            os.rmdir(args.out)
        return 2
    result.seconds = time.perf_counter() - t0
    paths = report.write(result, args.out, name, quick=args.quick)
    print(result.markdown(quick=args.quick))
    if temporary:
        print(f"quick run: wrote {', '.join(paths)} (a smoke run; the committed figures are untouched)")
    else:
        print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
