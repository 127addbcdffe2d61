"""Compare the runs of a sweep: one table, seed means, and the eval metric's curves.

    python -m favor.tools.report runs/sweep [--metric accuracy] [--plot runs/sweep/report.png] [--out report.md]
    python -m favor.tools.report runs/a runs/b ...          (run directories, or directories holding them)

A sweep directory (launch/sweep_local.py writes `sweep.json` there) lists every run it launched, so
runs that never started are listed too. Per run it reads what train.py leaves in the workdir:
config.json (the resolved config: which keys tell the runs apart), summary.json (final metrics, train
loss, steps/s, wall time, parameter count), the TensorBoard events (the eval curve; unfinished runs have
no summary yet) and launch/sweep_local.py's sweep_status.json (failed runs and their exit code).
Runs that differ only in a seed key (favor.sweeps.SEED_KEYS) are also reported as one setting,
mean ± sd over the seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from favor import sweeps

# metrics where smaller is better; any other (accuracy, f1, matthews, pearson, ...) is maximised
LOWER_IS_BETTER = ("loss", "wer", "cer", "error", "perplexity", "ppl", "mse")
# eval metrics tried in this order when --metric is not given
DEFAULT_METRICS = ("accuracy", "matthews", "f1", "pearson", "spearman", "wer", "loss")


def lower_is_better(metric: str) -> bool:
    """By the metric's words: `mlm_loss`, `wer`, `eval/perplexity` are minimised; `answer_f1` is not."""
    return any(word in LOWER_IS_BETTER for word in re.split(r"[^a-z0-9]+", metric.lower()))


def finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


@dataclass
class RunRecord:
    name: str
    workdir: Path
    overrides: dict = field(default_factory=dict)    # the sweep's overrides (empty outside a sweep)
    config: dict = field(default_factory=dict)       # config.json, flattened to dotted keys
    summary: dict | None = None
    sweep_status: dict | None = None
    curves: dict = field(default_factory=dict)       # TensorBoard tag -> [(step, value)]
    status: str = "not started"
    step: int | None = None
    error: str | None = None                         # a failed run's last log line (train.log)

    @property
    def settings(self) -> dict:
        return {**self.config, **{k: v for k, v in self.overrides.items() if k not in self.config}}


# -- reading ----------------------------------------------------------------------------------------------
def flatten(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete it or rerun the run") from e


def read_events(tb_dir: Path) -> dict:
    """Every scalar in the TensorBoard event files under `tb_dir` as tag -> [(step, value)], in step order
    (a resumed run appends files; a step written twice keeps its last value)."""
    if not tb_dir.is_dir():
        return {}
    # tensorboard's record reader and protos, loaded when a report reads events. Its TensorFlow-free reader:
    # tensorboard's event loader reads through TensorFlow whenever TensorFlow is installed (favor depends on
    # it for the data pipelines), and importing TensorFlow costs a report process seconds for the same records.
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow
    from tensorboard.util import tensor_util

    def events(path):
        reader = pywrap_tensorflow.PyRecordReader_New(str(path))
        while True:
            try:
                reader.GetNext()
            except errors.OutOfRangeError:
                return
            except errors.DataLossError:
                # a record cut short (a live run is writing it: the next report reads it whole) or one failing
                # its CRC: the file's whole records before it are what it holds, as TensorBoard reads it too
                return
            yield event_pb2.Event.FromString(reader.record())

    curves: dict = {}
    for f in sorted(tb_dir.rglob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name)):
        for event in events(f):
            for value in event.summary.value:
                if value.HasField("tensor"):
                    x = tensor_util.make_ndarray(value.tensor)
                elif value.HasField("simple_value"):
                    x = np.asarray(value.simple_value)
                else:
                    continue
                if x.size == 1 and np.issubdtype(x.dtype, np.number):
                    curves.setdefault(value.tag, {})[int(event.step)] = float(x.reshape(()))
    return {tag: sorted(points.items()) for tag, points in curves.items()}


def _alive(status: dict) -> bool:
    if status.get("host") != socket.gethostname():
        return True                      # another machine's run: trust what it wrote
    try:
        pid = int(status.get("pid", 0))
        if pid <= 0:                     # os.kill(0 or -1, 0) would ask about whole process groups
            return False
        os.kill(pid, 0)
        return True
    except (OSError, ValueError):
        return False


def classify(run: RunRecord) -> None:
    """Sets run.status and run.step from what the workdir holds."""
    total = run.settings.get("total_steps")
    steps = [s for points in run.curves.values() for s, _ in points] + ([run.summary["step"]] if run.summary else [])
    run.step = max(steps) if steps else None
    status = run.sweep_status or {}
    if status.get("status") == "failed":
        run.status = f"failed (exit {status.get('returncode')})"
    elif status.get("status") == "running" and _alive(status):   # its summary.json, if any, is an old one
        run.status = "running"
    elif run.summary is not None and not run.summary.get("preempted") and (total is None or run.step >= total):
        run.status = "finished"
    elif run.summary is not None and run.summary.get("preempted"):
        run.status = "preempted"
    elif status.get("status") in ("running", "stopped"):
        run.status = "stopped"
    elif run.workdir.is_dir():
        run.status = "unfinished"
    else:
        run.status = "not started"
    if run.status != "finished" and run.step is not None and total:
        run.status += f" at {run.step}/{total}"


def read_run(workdir: Path, name: str | None = None, overrides: dict | None = None) -> RunRecord:
    run = RunRecord(name or workdir.name, workdir, dict(overrides or {}))
    config = _json(workdir / "config.json")
    run.config = flatten(config) if config else {}
    run.summary = _json(workdir / "summary.json")
    run.sweep_status = _json(workdir / "sweep_status.json")
    run.curves = read_events(workdir / "tensorboard")
    classify(run)
    log = workdir / "train.log"
    if run.status.startswith("failed") and log.exists():
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        run.error = lines[-1][:300] if lines else None
    return run


def _is_run_dir(path: Path) -> bool:
    return any((path / f).exists() for f in ("config.json", "summary.json", "checkpoints", "sweep_status.json"))


def collect(paths) -> list[RunRecord]:
    """The runs that `paths` name: a sweep directory (sweep.json), a run directory, or a directory whose
    subdirectories are runs. A path that is none of these is a ValueError naming it."""
    out = []
    for p in map(Path, paths):
        if (p / "sweep.json").exists():
            sweep = _json(p / "sweep.json")
            out += [read_run(p / r["name"], r["name"], r["overrides"]) for r in sweep["runs"]]
        elif _is_run_dir(p):
            out.append(read_run(p))
        elif p.is_dir() and any(_is_run_dir(c) for c in p.iterdir() if c.is_dir()):
            out += [read_run(c) for c in sorted(p.iterdir()) if c.is_dir() and _is_run_dir(c)]
        else:
            raise ValueError(f"{p} is not a sweep directory (sweep.json), a run directory (config.json, "
                             f"summary.json or checkpoints/) or a directory of runs")
    names = [r.name for r in out]
    for r in out:                                    # same basename from two places: name by parent too
        if names.count(r.name) > 1:
            r.name = f"{r.workdir.parent.name}/{r.name}"
    return out


# -- comparing --------------------------------------------------------------------------------------------
def distinguishing_keys(runs) -> list[str]:
    """Config keys whose values differ between runs (a key a run does not record is not a difference),
    in the order the sweep's overrides, then the configs, name them; seed keys last."""
    keys = list(dict.fromkeys(k for r in runs for k in r.overrides))
    keys += [k for r in runs for k in r.config if k not in keys]
    keys = list(dict.fromkeys(keys))
    differ = [k for k in keys if len({json.dumps(r.settings[k], sort_keys=True) for r in runs if k in r.settings}) > 1]
    return sorted(differ, key=sweeps.is_seed_key)          # seed keys last (stable: the order otherwise)


def pick_metric(runs, metric: str | None) -> str:
    available = {k for r in runs if r.summary for k in r.summary} | \
                {t.split("/", 1)[1] for r in runs for t in r.curves if t.startswith("eval/")}
    if metric:
        if runs and available and metric not in available:
            raise ValueError(f"metric {metric!r} is in no run; the runs have: {', '.join(sorted(available))}")
        return metric
    for m in DEFAULT_METRICS:
        if m in available:
            return m
    raise ValueError(f"no eval metric found in these runs (looked for {', '.join(DEFAULT_METRICS)}); pass --metric")


def curve(run: RunRecord, metric: str):
    """[(step, wall seconds or None, value)] of the eval metric."""
    points = run.curves.get(f"eval/{metric}")
    if points:
        seconds = dict(run.curves.get("time/wall_seconds", []))
        return [(s, seconds.get(s), v) for s, v in points]
    history = (run.summary or {}).get("eval_history", [])
    return [(e["step"], e.get("seconds"), e[metric]) for e in history if metric in e]


def row(run: RunRecord, metric: str) -> dict:
    points = [p for p in curve(run, metric) if finite(p[2]) is not None]
    # the summary speaks for the run only when it ended (finished or preempted); a running run's
    # summary.json is its previous process's
    summary = (run.summary or {}) if run.status == "finished" or run.status.startswith("preempted") else {}
    if metric in summary:
        final = finite(summary[metric])          # a NaN final stays unknown (sorted last), not a best guess
    else:
        final = points[-1][2] if points else None
    best, best_step = None, None
    if points:
        pick = min if lower_is_better(metric) else max
        best_step, _, best = pick(points, key=lambda p: p[2])
    losses = [p for p in run.curves.get("loss", []) if finite(p[1]) is not None]
    train_loss = finite(summary.get("train_loss"))
    if train_loss is None and losses:
        train_loss = losses[-1][1]
    return {"name": run.name, "status": run.status, "step": run.step, "final": final, "best": best,
            "best_step": best_step, "train_loss": train_loss, "steps_per_second": summary.get("steps_per_second"),
            "wall_seconds": summary.get("wall_seconds"), "num_params": summary.get("num_params"),
            "error": run.error}


def seed_groups(runs, keys) -> list[tuple[dict, list[RunRecord]]]:
    """Runs grouped by their distinguishing keys other than seed keys, in first-seen order."""
    setting_keys = [k for k in keys if not sweeps.is_seed_key(k)]
    groups: dict = {}
    for r in runs:
        setting = {k: r.settings.get(k) for k in setting_keys}
        groups.setdefault(json.dumps(setting, sort_keys=True, default=str), (setting, []))[1].append(r)
    return list(groups.values())


def mean_sd(values):
    """(mean, sample sd, n) of the finite values; sd is None for fewer than two."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    if not x.size:
        return None, None, 0
    return float(x.mean()), (float(x.std(ddof=1)) if x.size > 1 else None), int(x.size)


def report(runs, metric: str | None = None) -> dict:
    """The comparison as data: the metric, the distinguishing keys, one row per run sorted by the final
    metric (best first; runs without one last, in their order) and the seed groups' mean ± sd."""
    metric = pick_metric(runs, metric)
    keys = distinguishing_keys(runs)
    rows = []
    for r in runs:
        rows.append({**row(r, metric), "settings": {k: r.settings.get(k) for k in keys}})
    sign = 1.0 if lower_is_better(metric) else -1.0
    rows.sort(key=lambda x: (x["final"] is None, sign * x["final"] if x["final"] is not None else 0.0))
    groups = []
    if any(sweeps.is_seed_key(k) for k in keys):
        for setting, members in seed_groups(runs, keys):
            done = [row(r, metric) for r in members if r.status == "finished"]
            groups.append({"settings": setting, "runs": len(members), "finished": len(done),
                           **{f"{stat}": mean_sd([d[stat] for d in done])
                              for stat in ("final", "best", "train_loss", "steps_per_second")}})
        groups.sort(key=lambda g: (g["final"][0] is None, sign * (g["final"][0] or 0.0)))
    parallel = max([int((r.sweep_status or {}).get("parallel", 1)) for r in runs] + [1])
    return {"metric": metric, "lower_is_better": lower_is_better(metric), "keys": keys, "rows": rows,
            "groups": groups, "parallel": parallel}


# -- writing ----------------------------------------------------------------------------------------------
def _short(keys):
    last = [k.split(".")[-1] for k in keys]
    return [k.split(".")[-1] if last.count(k.split(".")[-1]) == 1 else k for k in keys]


def _fmt(x, digits=4):
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _fmt_time(s):
    if s is None:
        return "–"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def _pm(stat, digits=4):
    mean, sd, n = stat
    if mean is None:
        return "–"
    return f"{mean:.{digits}g}" + (f" ± {sd:.2g}" if sd is not None else "")


def markdown(rep: dict) -> str:
    metric, keys = rep["metric"], rep["keys"]
    short = _short(keys)
    direction = "lower is better" if rep["lower_is_better"] else "higher is better"
    lines = [f"Eval metric: **{metric}** ({direction}); rows sorted by its final value.", "",
             "| run | " + " | ".join(short) + (" | " if short else "") +
             f"status | final {metric} | best {metric} (step) | train loss | steps/s | wall time | params |",
             "|" + "---|" * (len(short) + 8)]
    for r in rep["rows"]:
        best = "–" if r["best"] is None else f"{_fmt(r['best'])} ({r['best_step']})"
        cells = [r["name"], *(_value(r["settings"][k]) for k in keys), r["status"], _fmt(r["final"]), best,
                 _fmt(r["train_loss"]), _fmt(r["steps_per_second"], 3), _fmt_time(r["wall_seconds"]),
                 "–" if r["num_params"] is None else f"{r['num_params']:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    if rep["groups"]:
        setting_keys = [k for k in keys if not sweeps.is_seed_key(k)]
        lines += ["", "Mean ± sd over seeds (finished runs only):", "",
                  "| " + " | ".join(_short(setting_keys)) + (" | " if setting_keys else "") +
                  f"runs | final {metric} | best {metric} | train loss | steps/s |",
                  "|" + "---|" * (len(setting_keys) + 5)]
        for g in rep["groups"]:
            cells = [*(_value(g["settings"][k]) for k in setting_keys), f"{g['finished']}/{g['runs']}",
                     _pm(g["final"]), _pm(g["best"]), _pm(g["train_loss"]), _pm(g["steps_per_second"], 3)]
            lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rep["rows"] if r["status"].startswith("failed")]
    if failed:
        lines += ["", "Failed runs (the last line of each run's train.log):", ""]
        lines += [f"- {r['name']}: {r['error'] or '(no train.log: the sweep ran it in the foreground)'}" for r in failed]
    if rep.get("parallel", 1) > 1:
        lines += ["", f"Up to {rep['parallel']} runs shared this machine at once (sweep_local.py --parallel): "
                      f"their steps/s and wall times are below what each gets alone."]
    return "\n".join(lines) + "\n"


def _value(x) -> str:
    """A setting's value as the run names show it (an empty override is "none", the key's default)."""
    return "none" if x == "" else _fmt(x)


def _setting_label(setting: dict) -> str:
    keys = list(setting)
    return " ".join(f"{short}={_value(setting[k])}" for short, k in zip(_short(keys), keys)) or "base"


def plot(runs, rep: dict, out: Path, title: str = "") -> None:
    """Eval metric against step and against the run's wall-clock seconds, one line per run; runs of one
    setting share a colour, seeds differ by line style. With seeds, the legend names settings (one entry
    each, not one per run: a 3-seed ablation has dozens of runs) and a third panel gives each setting's
    final metric as mean ± sd, sorted, which is what the comparison is read from."""
    # plotting loads matplotlib only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metric = rep["metric"]
    groups = seed_groups(runs, rep["keys"])
    seeded = bool(rep["groups"])
    entries = len(groups) if seeded else len(runs)
    if seeded:
        fig, axes = plt.subplots(1, 3, figsize=(19, 5.2 + 0.16 * min(entries, 24)), layout="constrained",
                                 width_ratios=[1, 1, 0.9])
    else:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5.2 + 0.16 * min(entries, 24)), layout="constrained")
    colours = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    styles = ["-", "--", ":", "-."]
    colour_of = {}
    for gi, (setting, members) in enumerate(groups):
        colour_of[json.dumps(setting, sort_keys=True, default=str)] = colours(gi % colours.N)
        for si, r in enumerate(members):
            points = curve(r, metric)
            if not points:
                continue
            if seeded:
                label = _setting_label(setting) if si == 0 else None
            else:
                label = r.name + ("" if r.status == "finished" else f" [{r.status}]")
            style = dict(color=colours(gi % colours.N), linestyle=styles[si % len(styles)], marker="o", ms=3)
            axes[0].plot([p[0] for p in points], [p[2] for p in points], label=label, **style)
            timed = [p for p in points if p[1] is not None]
            if timed:
                axes[1].plot([p[1] for p in timed], [p[2] for p in timed], **style)
    axes[0].set_xlabel("training step")
    axes[1].set_xlabel("wall-clock time of the run (s, evaluation included)")
    times = [x for line in axes[1].get_lines() for x in line.get_xdata() if x > 0]
    if times and max(times) > 20 * min(times):       # one slow kind would squeeze every other curve
        axes[1].set_xscale("log")
        axes[1].set_xlabel("wall-clock time of the run (s, evaluation included; log scale)")
    for ax in axes[:2]:
        ax.set_ylabel(f"eval {metric}")
        ax.grid(alpha=0.3)
    better = "lower" if rep["lower_is_better"] else "higher"
    axes[0].set_title(f"eval {metric} vs step ({better} is better)")
    axes[1].set_title(f"eval {metric} vs time")
    if seeded:
        done = [g for g in rep["groups"] if g["final"][0] is not None]       # already sorted, best first
        ys = list(range(len(done)))[::-1]
        for y, g in zip(ys, done):
            mean, sd, n = g["final"]
            axes[2].barh(y, mean, xerr=sd or 0.0, capsize=3,
                         color=colour_of[json.dumps(g["settings"], sort_keys=True, default=str)])
            axes[2].text(mean + (sd or 0.0), y, f" {mean:.3g}" + (f" ± {sd:.2g}" if sd else "") + f" (n={n})",
                         va="center", fontsize=8)
        axes[2].set_yticks(ys, [_setting_label(g["settings"]) for g in done], fontsize=8)
        axes[2].set_xlabel(f"final eval {metric} (mean ± sd over seeds; {better} is better)")
        axes[2].set_title(f"final {metric} per setting")
        axes[2].grid(alpha=0.3, axis="x")
        if done:
            lo = min(g["final"][0] - (g["final"][1] or 0) for g in done)
            hi = max(g["final"][0] + (g["final"][1] or 0) for g in done)
            axes[2].set_xlim(max(0.0, lo - 0.05 * (hi - lo)) if lo >= 0 else lo, hi + 0.3 * (hi - lo or 1))
    # below the panels: with a dozen runs a legend inside would cover the curves
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=8, ncol=max(1, min(4, (len(labels) + 5) // 6)),
               title="line style: seed" if seeded else None, title_fontsize=8)
    if title:
        fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="a sweep directory, run directories, or directories of runs")
    p.add_argument("--metric", default=None, help=f"eval metric to compare (default: the first present of "
                                                  f"{', '.join(DEFAULT_METRICS)})")
    p.add_argument("--plot", default=None, help="write the eval curves to this PNG")
    p.add_argument("--out", default=None, help="also write the Markdown tables to this file")
    p.add_argument("--json", default=None, help="also write the comparison as JSON to this file")
    p.add_argument("--title", default=None, help="the plot's title (default: the paths' names)")
    args = p.parse_args(argv)
    try:
        runs = collect(args.paths)
        if not runs:
            raise ValueError(f"no runs in {', '.join(args.paths)}")
        rep = report(runs, args.metric)
    except ValueError as e:
        print(f"favor.tools.report: {e}", file=sys.stderr)
        return 2
    text = markdown(rep)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1, default=str))
    if args.plot:
        plot(runs, rep, Path(args.plot), title=args.title or " + ".join(Path(x).name for x in args.paths))
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
