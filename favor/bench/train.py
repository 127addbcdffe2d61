"""`python -m favor.bench train`: one train.py run as a user would start it (a fresh process, a fresh
workdir), its eval metric against wall-clock time. Time-to-target is the one figure here in seconds, because
the target itself is a time ("WER below 50 % within 10 minutes on 2 CPU cores")."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from favor.bench import sections


def train(config, metric, target, lower_is_better, flags, out_dir, section, argv):
    """One train.py run; the eval metric against wall-clock seconds and the time to reach `target`."""
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="favor-bench-") as workdir:
        t0 = time.perf_counter()
        code = subprocess.call([sys.executable, str(root / "train.py"), "--config", config, "--workdir", workdir,
                                *flags], cwd=root)
        wall = time.perf_counter() - t0
        if code:
            raise SystemExit(f"train.py exited with {code}")
        summary = json.loads((Path(workdir) / "summary.json").read_text())
    evals = summary.get("eval_history") or []
    if not evals or metric not in evals[0]:
        raise SystemExit(f"metric {metric!r} not in the run's eval metrics {sorted(evals[0]) if evals else []}")
    met = lambda v: v < target if lower_is_better else v > target
    first = next((e for e in evals if met(e[metric])), None)
    meta = sections.machine(argv, process_seconds=wall, target=target, metric=metric,
                            seconds_to_target=first["seconds"] if first else None)
    keys = [k for k in evals[0] if k not in ("step", "seconds")]
    rows = ["| step | seconds | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    rows += [f"| {e['step']} | {e['seconds']:.0f} | " + " | ".join(f"{e[k]:.4f}" for k in keys) + " |" for e in evals]
    verdict = (f"{metric} {'<' if lower_is_better else '>'} {target} first at step {first['step']}, "
               f"{first['seconds']:.0f} s after the run started" if first else f"{metric} never reached {target}")
    body = (f"{sections.heading(section, meta)}\n\n"
            f"{sections.where(meta)}; seconds count from the start of "
            f"`job.run` (data preparation, compilation and evaluation included); the whole process took "
            f"{wall:.0f} s. {verdict}. Raw figures: bench/{section}.json.\n\n" + "\n".join(rows))
    sections.publish(out_dir, section, body, {"meta": meta, "evals": evals})
    print(verdict)
    return meta


def add_parser(sub):
    t = sub.add_parser("train", help="a train.py run: eval metric against wall-clock time (flags after --)")
    t.add_argument("--config", required=True, help="configs/<file>.py[:args]")
    t.add_argument("--metric", required=True, help="an eval metric of the config's task (e.g. wer, accuracy)")
    t.add_argument("--target", type=float, required=True)
    t.add_argument("--higher_is_better", action="store_true", help="default: lower is better (error rates)")
    t.add_argument("--out", default=".")
    t.add_argument("--section", default="train-benchmark")


def main(args, flags, argv, parser):
    train(args.config, args.metric, args.target, not args.higher_is_better, flags, args.out, args.section, argv)
