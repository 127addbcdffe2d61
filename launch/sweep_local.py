"""Run a config's sweep on this machine: up to --parallel runs at once, resuming any that stopped.

    python launch/sweep_local.py --config configs/default.py --workdir runs/sweep [--parallel N]
        [--only 0,3-5] [--dry-run] [--count] [--fail-fast] [--devices-per-run K]
        [-- --config.total_steps=500 ...]            (extra flags go to every run)
    python -m favor.tools.report runs/sweep --plot runs/sweep/report.png

The config module's `sweep()` yields override dicts, products of several keys included
(favor.sweeps.product); each run gets `--config.<key>=<value>` flags and its own workdir
`<workdir>/<name>` named after them. `<workdir>/sweep.json` lists every run (favor.tools.report lists the
ones that never started too) and each run's `sweep_status.json` says running / finished / failed.

Rerunning the same command skips the finished runs and resumes the others from their checkpoints
(train.py resumes by itself). A failed run does not stop the others (unless --fail-fast); the sweep
exits non-zero at the end and names them. SIGTERM or Ctrl-C is passed on to the running runs, which
checkpoint and stop.

--parallel N: at most the number of CPU cores (each run needs one) and, with --devices-per-run K, the
GPUs this process sees divided by K (each run gets its own CUDA_VISIBLE_DEVICES). Runs that share a
machine share its cores: their steps/s are lower than alone, so compare speed only between runs of one
sweep (favor.tools.report's table says how many ran at once). With N > 1 each run's output goes to
`<run>/train.log`.

The runs share a persistent XLA compilation cache, `<workdir>/xla_cache` (unless JAX_COMPILATION_CACHE_DIR
is set): runs that differ only in their seed build the same programs, so only a setting's first run
compiles them.

On SLURM, launch/slurm_gpu.sbatch runs one array task per run through `--only $SLURM_ARRAY_TASK_ID`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from favor import sweeps  # noqa: E402  (after the path: run as a script from anywhere)
from favor.data import atomic  # noqa: E402


def parse_only(spec: str, n: int) -> list[int]:
    """'0,3-5' -> [0, 3, 4, 5]; an index outside 0..n-1, a reversed range or nothing at all is an error
    naming it."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise SystemExit(f"--only {spec!r}: {part!r} is not an index or a range like 3-5") from None
        if last < first:
            raise SystemExit(f"--only {spec!r}: {part!r} is a reversed range")
        for i in range(first, last + 1):
            if not 0 <= i < n:
                raise SystemExit(f"--only {spec!r}: run {i} does not exist (the sweep has runs 0..{n - 1})")
            out.append(i)
    if not out:
        raise SystemExit(f"--only {spec!r}: names no run")
    return list(dict.fromkeys(out))


def command(config: str, workdir: Path, run: sweeps.Run, extra: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--config", config, "--workdir", str(workdir / run.name),
            *run.flags(), *extra]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def read_status(run_dir: Path) -> dict:
    return read_json(run_dir / "sweep_status.json")


def primary() -> bool:
    """Whether this launcher writes the sweep's files: on a multi-node SLURM task or a TPU pod every host
    runs one, and the first host's is the record."""
    return all(os.environ.get(v, "0") == "0" for v in ("SLURM_PROCID", "TPU_WORKER_ID", "CLOUD_TPU_TASK_ID"))


def write_status(run_dir: Path, **status) -> None:
    if not primary():
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_text(run_dir / "sweep_status.json", json.dumps(status, indent=1))


def finished(run_dir: Path, cmd: list[str]) -> bool:
    """The run ended by itself (not by SIGTERM) with this command line (the interpreter's path aside)."""
    status = read_status(run_dir)
    return status.get("status") == "finished" and status.get("command", [None])[1:] == cmd[1:]


def visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def plan_parallel(requested: int, devices_per_run: int) -> tuple[int, list[list[str]]]:
    """(runs at once, device slices): --parallel capped by the cores and, with devices per run, the GPUs."""
    n = min(requested, os.cpu_count() or 1)
    if n < requested:
        print(f"sweep: --parallel {requested} > {os.cpu_count()} CPU cores; running {n} at once", flush=True)
    if not devices_per_run:
        return n, []
    gpus = visible_gpus()
    slices = [gpus[i:i + devices_per_run] for i in range(0, len(gpus) - devices_per_run + 1, devices_per_run)]
    if not slices:
        raise SystemExit(f"--devices-per-run {devices_per_run}: this process sees {len(gpus)} GPU(s) "
                         f"({', '.join(gpus) or 'none'})")
    if len(slices) < n:
        print(f"sweep: {len(gpus)} GPUs / {devices_per_run} per run: running {len(slices)} at once", flush=True)
    return min(n, len(slices)), slices


class Sweep:
    """Starts runs as slots free up, records each one's status, and passes SIGTERM on to them."""

    def __init__(self, parallel: int, slices: list[list[str]], fail_fast: bool, cache_dir: Path | None = None):
        self.parallel, self.slices, self.fail_fast = parallel, slices, fail_fast
        self.cache_dir = cache_dir
        self.running: dict = {}        # Popen -> (run, run_dir, command, log file, slice index)
        self.failed: list = []
        self.stopped: list = []        # ended by SIGTERM with a checkpoint: a rerun resumes them
        self.stopping = False

    def start(self, run, run_dir: Path, cmd: list[str]):
        env = dict(os.environ)
        if self.cache_dir is not None:
            env.setdefault("JAX_COMPILATION_CACHE_DIR", str(self.cache_dir))
        free = sorted(set(range(len(self.slices))) - {v[4] for v in self.running.values()})
        slot = free[0] if self.slices else None
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.slices[slot])
        log = None
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.parallel > 1:
            log = open(run_dir / "train.log", "a")
            log.write(f"\n### {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
            log.flush()
        # a session of its own: Ctrl-C reaches only this launcher, which passes SIGTERM on (train.py
        # checkpoints on SIGTERM; a SIGINT would end it with a traceback and no checkpoint)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                                start_new_session=True)
        write_status(run_dir, status="running", command=cmd, host=socket.gethostname(), pid=proc.pid,
                     started=time.time(), parallel=self.parallel)
        self.running[proc] = (run, run_dir, cmd, log, slot)
        if self.stopping:              # a signal that came while it started
            proc.send_signal(signal.SIGTERM)
        print(f"sweep: started run {run.index} {run.name} (pid {proc.pid})", flush=True)

    def reap(self, block: bool):
        while self.running:
            for proc in list(self.running):
                code = proc.poll()
                if code is None:
                    continue
                run, run_dir, cmd, log, _ = self.running.pop(proc)
                if log:
                    log.close()
                prior = read_status(run_dir)
                # exit 0 after SIGTERM (ours, SLURM's, a preemption's) is a checkpointed stop, not the end
                preempted = read_json(run_dir / "summary.json").get("preempted", True)
                status = "failed" if code and not self.stopping else \
                    "stopped" if code or preempted else "finished"
                write_status(run_dir, status=status, returncode=code, command=cmd, host=socket.gethostname(),
                             started=prior.get("started"), ended=time.time(), parallel=self.parallel)
                print(f"sweep: run {run.index} {run.name} {status}" + (f" (exit code {code})" if code else ""),
                      flush=True)
                if status == "stopped":
                    self.stopped.append(run)
                if status == "failed":
                    self.failed.append((run, run_dir, code))
                    if self.fail_fast:
                        self.stop(signal.SIGTERM)
                return
            if not block:
                return
            time.sleep(0.5)

    def stop(self, signum):
        self.stopping = True
        for proc in self.running:
            proc.send_signal(signum)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="config file with a sweep() function (path.py or path.py:arg)")
    p.add_argument("--workdir", required=True, help="the sweep directory; each run gets a subdirectory")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (capped by cores and GPUs)")
    p.add_argument("--only", default="", help="run only these runs of the sweep: indices and ranges, '0,3-5'")
    p.add_argument("--devices-per-run", "--devices_per_run", type=int, default=0,
                   help="give each run its own K GPUs through CUDA_VISIBLE_DEVICES")
    p.add_argument("--fail-fast", "--fail_fast", action="store_true", help="stop every run when one fails")
    p.add_argument("--dry-run", "--dry_run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--count", action="store_true", help="print the number of runs in the sweep and exit")
    args = p.parse_args(argv)
    if args.parallel < 1:
        raise SystemExit(f"--parallel {args.parallel}: expected 1 or more")
    try:
        runs = sweeps.load(args.config)
    except ValueError as e:
        raise SystemExit(f"sweep: {e}") from None
    if args.count:
        print(len(runs))
        return
    selected = [runs[i] for i in parse_only(args.only, len(runs))] if args.only else runs
    workdir = Path(args.workdir)
    cmds = [(run, workdir / run.name, command(args.config, workdir, run, extra)) for run in selected]
    if args.dry_run:
        for _, _, cmd in cmds:
            print(" ".join(cmd), flush=True)
        return
    workdir.mkdir(parents=True, exist_ok=True)
    # the whole sweep's list, whichever runs this process runs (array tasks each write the same file)
    if primary():
        atomic.write_text(workdir / "sweep.json", json.dumps(
            {"config": args.config, "extra": extra,
             "runs": [{"index": r.index, "name": r.name, "overrides": r.overrides} for r in runs]}, indent=1, default=str))
    parallel, slices = plan_parallel(args.parallel, args.devices_per_run)
    sweep = Sweep(parallel, slices, args.fail_fast, workdir / "xla_cache")
    previous = {s: signal.signal(s, lambda signum, frame: sweep.stop(signal.SIGTERM))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for run, run_dir, cmd in cmds:
            if finished(run_dir, cmd):
                print(f"sweep: run {run.index} {run.name} finished already; skipped", flush=True)
                continue
            while len(sweep.running) >= parallel and not sweep.stopping:
                sweep.reap(block=True)
            if sweep.stopping:
                break
            sweep.start(run, run_dir, cmd)
        sweep.reap(block=True)
        while sweep.running:
            sweep.reap(block=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if sweep.failed:
        print("sweep: failed runs:\n" + "\n".join(
            f"  {run.index} {run.name}: exit code {code}" + (f", log {d / 'train.log'}" if parallel > 1 else "")
            for run, d, code in sweep.failed), file=sys.stderr, flush=True)
        sys.exit(1)
    if sweep.stopping or sweep.stopped:
        print("sweep: stopped" + "".join(f"\n  {run.index} {run.name}" for run in sweep.stopped) +
              "\nrerun the same command to resume", file=sys.stderr, flush=True)
        sys.exit(143)
    print(f"sweep: done; compare with  python -m favor.tools.report {workdir}", flush=True)


if __name__ == "__main__":
    main()
