"""Run a config's sweep on this machine, one run after another.

    python launch/sweep_local.py --config configs/default.py --workdir runs/sweep [--dry-run]
        [-- --config.total_steps=500 ...]            (extra flags go to every run)

The config module's `sweep()` yields override dicts ({"model.attention.kind": "favor#"}); each run
gets `--config.<key>=<value>` flags and its own workdir named after them. A run that fails stops
the sweep with its exit code; rerunning resumes every run from its checkpoints.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from favor import configlib  # noqa: E402  (after the path: run as a script from anywhere)


def load_sweep(config_path: str):
    path = config_path.split(":", 1)[0]
    module = configlib.load_module(path)
    if not hasattr(module, "sweep"):
        raise SystemExit(f"{path} has no sweep() function")
    return list(module.sweep())


def run_name(overrides: dict) -> str:
    return "_".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items()) or "base"


def commands(config: str, workdir: str, extra: list[str]):
    for overrides in load_sweep(config):
        name = re.sub(r"[^A-Za-z0-9=._+#-]", "-", run_name(overrides))
        flags = [f"--config.{k}={v}" for k, v in overrides.items()]
        yield [sys.executable, str(ROOT / "train.py"), "--config", config, "--workdir",
               str(Path(workdir) / name), *flags, *extra]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    for cmd in commands(args.config, args.workdir, extra):
        print(" ".join(cmd), flush=True)
        if not args.dry_run:
            code = subprocess.call(cmd)
            if code:
                sys.exit(code)


if __name__ == "__main__":
    main()
