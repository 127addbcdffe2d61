"""What the reproductions that train share: a config's sweep run by launch/sweep_local.py (parallel,
resumable: a rerun skips the finished runs and resumes the others from their checkpoints), read back
by favor.tools.report, each setting's final metric as mean ± sd over its seeds, and two settings
compared at two standard errors.

A comparison's standard error is that of a difference of two means over independent seeds,
√(sd_a²/n_a + sd_b²/n_b) with the sample sd (ddof 1): Welch's, without its degrees-of-freedom
correction. With three seeds a side it is itself noisy: the difference over it follows a t
distribution with 2–4 degrees of freedom, not a normal one, so a true tie passes 2 SE one way about
6–9 % of the time (2.3 % for a normal), and a verdict "within noise" says the budget did not separate
the two, not that they are equal.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from favor import strings
from favor.repro.report import verdict
from favor.tools import report as sweep_report

ROOT = Path(__file__).resolve().parents[2]      # the checkout: configs/ and launch/ live beside favor/


class SweepError(RuntimeError):
    """A sweep that did not finish, or whose runs lack the metric: `python -m favor.repro` prints it and
    exits 2 (any other error keeps its traceback)."""


@dataclasses.dataclass(frozen=True)
class Stat:
    """One setting's final metric over its seeds."""
    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def sd(self) -> float:
        return float(np.std(self.values, ddof=1)) if self.n > 1 else math.nan

    def text(self, scale=100.0, digits=1) -> str:
        return f"{scale * self.mean:.{digits}f} ± {scale * self.sd:.{digits}f}" if self.n > 1 else \
            f"{scale * self.mean:.{digits}f}"


def difference(a: Stat, b: Stat) -> tuple[float, float]:
    """(mean_a − mean_b, its standard error)."""
    se = math.sqrt(a.sd ** 2 / a.n + b.sd ** 2 / b.n) if a.n > 1 and b.n > 1 else math.nan
    return a.mean - b.mean, se


def rate(better: Stat, worse: Stat, higher_is_better=True, margin=2.0) -> tuple[str, float]:
    """The claim "`better` beats `worse`" against the figures: (verdict, z) with z the difference in the
    claim's direction over its standard error (report.verdict: agrees beyond `margin` SE, disagrees
    beyond −margin, else within noise). Equal figures with no spread are within noise."""
    diff, se = difference(better, worse)
    diff = diff if higher_is_better else -diff
    if not se > 0:
        z = 0.0 if diff == 0 or math.isnan(se) else math.copysign(math.inf, diff)
    else:
        z = diff / se
    return verdict(z, margin), z


def claim(settings: dict, better: str, worse: str, why: str, alone: bool = False) -> tuple[str, str]:
    """The claim "`better` beats `worse`" on two settings' accuracies as a report comparison:
    ("better (mean ± sd %) > worse[ alone] (mean ± sd %)<why> (z = …)", verdict); `why` starts with its
    own separator (" — paper", ": reason")."""
    a, b = settings[better]["stat"], settings[worse]["stat"]
    v, z = rate(a, b)
    return (f"{better} ({a.text()} %) > {worse}{' alone' if alone else ''} ({b.text()} %){why} (z = {z:.1f})", v)


def config_path(name: str) -> str:
    """A config of the checkout, e.g. "listops.py" -> <root>/configs/listops.py (an error naming it when the
    package runs from somewhere without the checkout's configs/)."""
    path = ROOT / "configs" / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: the reproductions that train run the checkout's configs/ and "
                                "launch/ (run from a clone of favor)")
    # a config may import its siblings as the package `configs` (configs/linearize.py does), and the
    # reproductions load configs in this process too, not only through train.py: the checkout's root goes
    # first on the path, as launch/sweep_local.py puts it, so that import works from any working directory
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return str(path)


def checkout_spec(config: str) -> str:
    """A config spec as a user runs it from the checkout's root: "<root>/configs/mqar.py:seeds=3" ->
    "configs/mqar.py:seeds=3" (the arg may hold ":" and "/": kinds=favor#:saderf/favor+)."""
    path, arg = strings.config_spec(config)
    return f"configs/{Path(path).name}" + (f":{arg}" if arg else "")


def run_sweep(config: str, workdir: Path, parallel: int, extra=()) -> list:
    """Runs the sweep of `config` ("path.py:arg") in `workdir` with launch/sweep_local.py and returns its
    runs (favor.tools.report records); `extra` flags go to every run. The launcher's output goes to
    <workdir>/sweep.log. A workdir that holds another config's sweep (or the same with other flags), a
    launcher that fails before any run starts, or a run that fails or stops is a SweepError naming it: a
    reproduction never rates a partial or mixed sweep (rerunning the same command resumes it)."""
    workdir = Path(workdir)
    listing = workdir / "sweep.json"
    if listing.exists():
        previous = json.loads(listing.read_text())
        if previous.get("config") != config or previous.get("extra", []) != list(extra):
            was = " ".join([str(previous.get("config")), *previous.get("extra", [])])
            raise SweepError(f"{workdir} holds the sweep of another config ({was}); this one is "
                             f"{' '.join([config, *extra])}: give another --workdir, or remove that one")
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "launch" / "sweep_local.py"), "--config", config, "--workdir", str(workdir),
           "--parallel", str(parallel)] + (["--", *extra] if extra else [])
    with open(workdir / "sweep.log", "a") as log:
        log.write("### " + " ".join(cmd) + "\n")
        log.flush()
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    if done.returncode:
        lines = [ln.strip() for ln in (workdir / "sweep.log").read_text(errors="replace").splitlines() if ln.strip()]
        if not listing.exists():
            raise SweepError(f"the sweep launcher failed before starting a run (exit code {done.returncode}): "
                             f"{lines[-1] if lines else 'no output'} (log: {workdir}/sweep.log)")
        failed = "; ".join(f"{r.name}: {r.status}" + (f" ({r.error})" if r.error else "")
                           for r in sweep_report.collect([workdir]) if r.status != "finished")
        raise SweepError(f"the sweep in {workdir} did not finish (launcher exit code {done.returncode}): "
                         f"{failed or (lines[-1] if lines else 'no output')}; logs: {workdir}/sweep.log and "
                         "each run's train.log. Rerun the same command to resume it.")
    runs = sweep_report.collect([workdir])
    unfinished = [r.name for r in runs if r.status != "finished"]
    if unfinished:                # after a clean exit only if another process works in the same directory
        raise SweepError(f"{workdir}: runs {', '.join(unfinished)} are not finished although the launcher "
                         "ended cleanly; is another sweep running there?")
    return runs


def timing(runs) -> str:
    """", N runs in M min of wall clock, K at a time": the time during which some run of the sweep was going,
    from the starts and ends the launcher recorded (sweep_status.json), so what the sweep cost whichever
    process later reads it back. A sweep resumed later does not count the pause between its sessions.
    "" when a run lacks the record."""
    status = [r.sweep_status or {} for r in runs]
    if not runs or any(s.get("started") is None or s.get("ended") is None for s in status):
        return ""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted((s["started"], s["ended"]) for s in status):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    parallel = max(int(s.get("parallel", 1)) for s in status)
    return f", {len(runs)} runs in {busy / 60:.0f} min of wall clock, {parallel} at a time"


def final_metric(run, metric: str) -> float:
    value = sweep_report.row(run, metric)["final"]
    if value is None:
        raise SweepError(f"run {run.name} has no final {metric!r} (its summary.json and eval curve lack it)")
    return float(value)


def curve(run, metric: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, _, v in sweep_report.curve(run, metric)]


def by_setting(runs, label, metric: str) -> dict[str, dict]:
    """{label(run): {"stat": Stat of the final metric, "runs": [run, ...]}} in first-seen order; `label`
    names a run's setting (its seed aside)."""
    out: dict[str, dict] = {}
    for r in runs:
        entry = out.setdefault(label(r), {"runs": []})
        entry["runs"].append(r)
    for entry in out.values():
        entry["stat"] = Stat(tuple(final_metric(r, metric) for r in entry["runs"]))
    return out


def mean_curve(runs, metric: str):
    """(steps, mean, sd) of the eval metric over runs, on the steps every run evaluated."""
    curves = [dict(curve(r, metric)) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    values = np.array([[c[s] for s in steps] for c in curves], np.float64)
    sd = values.std(0, ddof=1) if len(curves) > 1 else np.zeros(len(steps))
    return steps, values.mean(0), sd


def plot_settings(fig, settings: dict, metric: str, title: str, scale=100.0, unit="%", reference=None,
                  higher_is_better=True):
    """Left: the eval metric against the step, the mean over seeds (band: ± sd). Right: each setting's
    final metric, every seed a dot and the mean a diamond with ± 2 SE whiskers, sorted best first;
    `reference` (a label) draws a vertical line at that setting's mean, the one the others are read
    against."""
    ax_curve, ax_bar = fig.subplots(1, 2, width_ratios=[1, 1.1])
    import matplotlib
    colours = matplotlib.colormaps["tab20"]
    order = sorted(settings, key=lambda k: settings[k]["stat"].mean * (-1 if higher_is_better else 1))
    colour = {k: colours(i % 20) for i, k in enumerate(settings)}
    for k, entry in settings.items():
        steps, mean, sd = mean_curve(entry["runs"], metric)
        ax_curve.plot(steps, scale * mean, marker="o", ms=3, color=colour[k], label=k)
        ax_curve.fill_between(steps, scale * (mean - sd), scale * (mean + sd), color=colour[k], alpha=0.15)
    ax_curve.set_xlabel("training step")
    ax_curve.set_ylabel(f"eval {metric} ({unit}), mean over seeds ± sd")
    ax_curve.grid(alpha=0.3)
    ax_curve.set_title(f"eval {metric} during training")
    ys = np.arange(len(order))[::-1]
    for y, k in zip(ys, order):
        stat = settings[k]["stat"]
        se = stat.sd / math.sqrt(stat.n) if stat.n > 1 else 0.0
        ax_bar.errorbar(scale * stat.mean, y, xerr=2 * scale * se, fmt="D", color=colour[k], ms=7, capsize=4)
        ax_bar.plot([scale * v for v in stat.values], [y] * stat.n, "k.", ms=4)
        ax_bar.text(scale * (stat.mean + 2 * se), y, f"  {stat.text(scale)}" + (" (sd)" if stat.n > 1 else ""),
                    va="center", fontsize=8)
    if reference in settings:
        ax_bar.axvline(scale * settings[reference]["stat"].mean, color="k", ls="--", lw=1,
                       label=f"{reference} (mean)")
        ax_bar.legend(loc="upper right", bbox_to_anchor=(1.0, -0.14), fontsize=8)     # below: clear of the labels
    ax_bar.set_yticks(ys, order, fontsize=8)
    n = min(s["stat"].n for s in settings.values())
    ax_bar.set_xlabel(f"final eval {metric} ({unit}): seeds as dots, ◆ mean ± 2 SE (n = {n})")
    lo = min(min(s["stat"].values) for s in settings.values())
    hi = max(max(s["stat"].values) for s in settings.values())
    pad = 0.08 * (hi - lo or 1.0)
    ax_bar.set_xlim(scale * (lo - pad), scale * (hi + 4 * pad))
    ax_bar.grid(alpha=0.3, axis="x")
    ax_bar.set_title(f"final {metric} per setting (best first)")
    ax_curve.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=4)
    fig.suptitle(title)


def add_sweep_arguments(parser):
    """The options every trained reproduction takes: how many runs at once, and where the sweep lives."""
    parser.add_argument("--parallel", type=int, default=min(2, os.cpu_count() or 1),
                        help="runs at once (default %(default)s)")
    parser.add_argument("--workdir", default=None,
                        help="the sweep's directory (default <out>/runs); rerunning resumes it and reuses "
                             "its finished runs")


def sweep_workdir(args) -> Path:
    return Path(args.workdir or os.path.join(args.out, "runs"))


def setting_rows(settings: dict, reference: str, higher_is_better=True) -> list[list]:
    """A table row per setting, best first: [label, mean ± sd, Δ vs `reference` ± SE, steps/s (mean over
    the runs that timed themselves), parameters, seeds]."""
    ref = settings.get(reference)
    rows = []
    for label, entry in sorted(settings.items(), key=lambda kv: kv[1]["stat"].mean * (-1 if higher_is_better else 1)):
        stat = entry["stat"]
        delta = None
        if ref is not None and label != reference:
            diff, se = difference(stat, ref["stat"])
            delta = f"{100 * diff:+.1f} ± {100 * se:.1f}"
        speed = [r.summary["steps_per_second"] for r in entry["runs"]      # None: a run resumed at its end
                 if r.summary and r.summary.get("steps_per_second") is not None]
        rows.append([label, stat.text(), delta, f"{sum(speed) / len(speed):.2g}" if speed else None,
                     (entry["runs"][0].summary or {}).get("num_params"), stat.n])
    return rows


def settings_figures(settings: dict, metric: str) -> dict:
    """The raw figures of each setting for the report's JSON: its seeds' values, mean, sd, runs and curves."""
    return {k: {"values": list(e["stat"].values), "mean": e["stat"].mean, "sd": e["stat"].sd,
                "runs": [r.name for r in e["runs"]], "curves": {r.name: curve(r, metric) for r in e["runs"]}}
            for k, e in settings.items()}


def complete(settings: dict, asked: list, runs, seeds: int, metric: str) -> tuple[str, bool]:
    """The check every trained report makes first: the sweep holds exactly the settings asked for, each
    with every seed finished."""
    return (f"the sweep's {len(runs)} runs are the {len(asked)} settings asked for × {seeds} seeds, each "
            f"finished with a final validation {metric}",
            sorted(settings) == sorted(asked) and all(e["stat"].n == seeds for e in settings.values()))
