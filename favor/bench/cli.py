"""`python -m favor.bench SUBCOMMAND ...`: the command line of every benchmark (favor/bench/__init__.py
lists them). Each subcommand is a module of this package with `add_parser(subparsers)` and
`main(args, flags, argv, parser)`; flags after `--` go to the config of the subcommands that train.

The modules import the training stack (TensorFlow's data pipelines among it) only when a subcommand that
trains runs, so the attention benchmarks time their programs in a process without it.
"""

from __future__ import annotations

import argparse
import sys

from favor import extras
from favor.config.checks import UsageError
from favor.bench import (accel, attention, context, generate, headline, lora, parts, peers, ratios, steps, train,
                         tune, uptrain)

SUBCOMMANDS = {"attention": attention, "ratios": ratios, "parts": parts, "train": train, "steps": steps,
               "uptrain": uptrain, "peers": peers, "generate": generate, "accel": accel,
               "tune": tune, "lora": lora, "context": context, "headline": headline}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv_main = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m favor.bench",
                                     description="Benchmarks of favor's attention, training and uptraining.")
    sub = parser.add_subparsers(dest="what", required=True)
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    args = parser.parse_args(argv_main)
    try:
        return SUBCOMMANDS[args.what].main(args, flags, argv, parser)
    except (extras.MissingExtra, UsageError) as e:   # a config whose data pipeline needs an optional package,
        parser.exit(2, f"error: {e}\n")            # or a --workdir holding a run of another configuration
