"""Uptraining a softmax model into each random-feature kind (FAVOR# Table 1, CRT Table 2 and Fig. 4): the
digits ViT and a BERT-MLM pretrained on the docstrings, each continued as every kind on its own task, at
day 0 and after K steps."""

from __future__ import annotations

import math

import numpy as np

from favor import attention, strings
from favor.config import loading
from favor import sweeps
from favor.data import local
from favor.repro import trained
from favor.repro.report import Report

NAME = "uptrain-kernels"
SUMMARY = ("A softmax digits ViT and a softmax BERT-MLM uptrained as FAVOR+, FAVOR++, FAVOR# (SADERF, SDERF), "
           "ELU, ReLU: day 0 and after K steps; 3 seeds")
PROTOCOL = """\
The papers' uptraining claims: FAVOR# Table 1 (warm-started from a pretrained BERT, FAVOR# with SADERF
features is best on most GLUE tasks, ahead of FAVOR++, FAVOR+, ELU and ReLU), CRT Table 2 ("Uptrain
FAVOR++": FAVOR++ uptrained from a softmax checkpoint beats FAVOR+) and CRT Fig. 4 (on ViT, FAVOR++
is more stable than FAVOR+, especially when uptrained). Each side trains one softmax source, then
continues it as every setting (`model.init_from=run:<source>`: the source's parameters, the kind's own
features) for K steps of the source's own task at a quarter of the source's peak learning rate
(fine-tuning practice: the full rate undoes much of what the model inherits), warmup a tenth of K; the
softmax setting continues the source unchanged, the reference. Day 0 is the evaluation before the first
step (the source's parameters and head with the kind's features drawn by the run's seed), "after K" the
final evaluation; the papers' claims are rated after K, day 0 is favor's own measure of what a kind
inherits. Each setting is uptrained `--seeds` times (seeds 0, 1, 2: the feature draws, data order and
dropout); mean ± sd over seeds; claims rated at 2 standard errors of the difference of means
(favor.repro.trained).

- ViT: configs/default.py (the digits ViT, 2 layers, 64 wide, 64 features), the source trained 1,500
  steps; K = `--vit-steps` (default 300).
- BERT: configs/bert_pretrain.py:data=local (a BERT-MLM 2 layers × 128 wide, BERT-Tiny's size, 64
  features, on the standard library's docstrings: 128 tokens, a 1,000-piece sentencepiece vocabulary,
  batch 64, AdamW at 3e-3), the source pretrained `--bert-source-steps` steps (default 2,000) and required
  to reach 30 % masked-token accuracy (a source that predicts only frequent pieces says little about
  what a kind inherits); uptrained K = `--bert-steps` (default 300) steps of masked-language modelling,
  scored by masked-token accuracy on 512 held-out rows.

Where favor differs from the papers: models thousands of times smaller (BERT-base and ViT-B/L there),
digits in place of ImageNet, the BERT continued on its pretraining task rather than fine-tuned on GLUE,
sources trained minutes rather than days, and uptraining budgets of hundreds of steps. An earlier BERT
side fine-tuned the source on favor's sentence-order task (which of two docstring sentences comes
first): every kind stayed at chance (49–53 %) and softmax reached 56.6 ± 3.4 %, so it rated no kernel;
masked-language modelling is a task the source already does, so day 0 and the steps after it read
what each kind inherits.
"""

NAMES = {"softmax": "softmax", "favor+": "FAVOR+", "favor++": "FAVOR++", "favor#": "FAVOR#", "elu": "ELU",
         "relu": "ReLU", "favor": "trig", "hrf": "HRF", "simrf": "SimRF"}
KINDS = "favor+/favor++/favor#:saderf/favor#:sderf/elu/relu"
SIDES = ("vit", "bert")
SIDE_NAMES = {"vit": "digits ViT", "bert": "BERT-MLM"}
CHANCE = {"vit": 0.1, "bert": 0.001}          # ten digits; one of the 1,000 pieces
SOURCE_MIN_MLM = 0.30          # the BERT source's masked-token accuracy the protocol asks for (a priori)
LR_FACTOR = 0.25               # the ViT's uptraining peak learning rate, a fraction of the source's
# (better, worse, whose claim, sides where it is the paper's)
PAPER_CLAIMS = (
    ("FAVOR++", "FAVOR+", "CRT Table 2, Uptrain FAVOR++ (and Fig. 4 on ViT)", ("vit",)),
    ("FAVOR# (SADERF)", "FAVOR++", "FAVOR# Table 1 (from BERT; GLUE there)", ("bert",)),
    ("FAVOR# (SADERF)", "FAVOR+", "FAVOR# Table 1 (from BERT; GLUE there)", ("bert",)),
    ("FAVOR# (SADERF)", "ELU", "FAVOR# Table 1 (from BERT; GLUE there)", ("bert",)),
    ("FAVOR# (SADERF)", "ReLU", "FAVOR# Table 1 (from BERT; GLUE there)", ("bert",)),
)


def add_arguments(parser):
    parser.add_argument("--sides", default=None, help="'/'-separated models: vit, bert (default both; --quick vit)")
    parser.add_argument("--kinds", default=None, help=f"'/'-separated kind specs uptrained besides softmax "
                                                      f"(default {KINDS}; --quick favor+)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per setting (default 3; --quick 2)")
    parser.add_argument("--vit-steps", type=int, default=None, help="ViT uptraining steps K (default 300)")
    parser.add_argument("--bert-steps", type=int, default=None, help="BERT uptraining steps K (default 300)")
    parser.add_argument("--bert-source-steps", type=int, default=None,
                        help="the BERT source's pretraining steps (default 2000)")
    trained.add_sweep_arguments(parser)


def setting_label(kind: str, options: dict) -> str:
    """A setting's name from its kind and attention options (a kind spec's, or a run's): the kind, the value
    of the option its spec's variant sets (FAVOR#'s variant, HRF's lambda_, SimRF's features; empty or
    absent: the kind's own) and a window: "FAVOR# (SADERF)", "FAVOR# (SDERF)", "HRF (gaussian) + band 8"."""
    name = NAMES.get(kind, kind)
    own = attention.get(kind)                       # the kind with its own defaults
    if own.SPEC_OPTION:
        value = options.get(own.SPEC_OPTION) or own.options[own.SPEC_OPTION]
        name += f" ({value.upper() if kind == 'favor#' else value})"        # FAVOR#'s are acronyms
    window = int(options.get("window") or 0)
    return name + (f" + band {window}" if window else "")


def _overrides_label(settings: dict) -> str:
    """setting_label of a run's dotted settings (a sweep item's overrides, or a finished run's config)."""
    options = {k.removeprefix("model.attention."): v for k, v in settings.items() if k.startswith("model.attention.")}
    return setting_label(options.pop("kind"), options)


def _label(run):
    return _overrides_label(run.settings)


def plan(args) -> dict:
    """{side: {"source": (config, extra), "uptrain": (config, extra with init_from added later), "steps": K}}:
    the sweeps each side runs, from the options (checked here, before anything trains)."""
    quick = args.quick
    seeds = args.seeds if args.seeds is not None else (2 if quick else 3)
    if seeds < 2:
        raise ValueError(f"--seeds {seeds}: a comparison at 2 standard errors needs at least 2 seeds a setting")
    sides = strings.choices("--sides", args.sides or ("vit" if quick else "vit/bert"), SIDES, nonempty=True)
    numbers = {"--vit-steps": args.vit_steps, "--bert-steps": args.bert_steps,
               "--bert-source-steps": args.bert_source_steps}
    if quick and any(v is not None for v in numbers.values()):
        raise ValueError(f"{', '.join(f'{k} {v}' for k, v in numbers.items() if v is not None)} with --quick: the quick "
                         "run uptrains the tests' model a few steps")
    if args.parallel < 1 or any(v is not None and v < 1 for v in numbers.values()):
        raise ValueError("--parallel, --vit-steps, --bert-steps and --bert-source-steps must be positive")
    kinds = args.kinds or ("favor+" if quick else KINDS)
    specs = "/".join(["softmax"] + [k for k in strings.items(kinds) if k != "softmax"])
    # a bad spec fails here, before a source trains; the asked names are those the runs will carry
    labels = [_overrides_label(item) for item in sweeps.kind_settings("--kinds", specs)]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--kinds {kinds!r}: two specs name one setting ({', '.join(labels)})")
    extra = "runlocal," if quick else ""
    out = {}
    if "vit" in sides:
        steps = 8 if quick else (args.vit_steps or 300)
        source = trained.config_path("default.py") + f":{extra}seeds=1,kinds=softmax"
        out["vit"] = {"source": (source, []), "steps": steps, "metric": "accuracy",
                      "uptrain": (trained.config_path("default.py") + f":{extra}seeds={seeds},kinds={specs}",
                                  _uptrain_flags(trained.config_path("default.py") + f":{extra}", steps))}
    if "bert" in sides:
        steps = 12 if quick else (args.bert_steps or 300)
        source_steps = 40 if quick else (args.bert_source_steps or 2000)
        config = trained.config_path("bert_pretrain.py") + f":data=local,{extra}"
        every = -(-source_steps // 5)
        flags = [f"--config.total_steps={source_steps}", f"--config.eval_every={every}",
                 f"--config.checkpoint_every={every}"]
        out["bert"] = {"source": (config + "seeds=1,kinds=softmax", flags), "steps": steps, "metric": "accuracy",
                       "uptrain": (config + f"seeds={seeds},kinds={specs}", _uptrain_flags(config, steps))}
    for side in out.values():
        side["seeds"] = seeds
        side["asked"] = labels
    return out


def _uptrain_flags(config: str, steps: int) -> list[str]:
    """K steps at LR_FACTOR of the config's peak learning rate, warmup at most a tenth of K, five evaluations."""
    base = loading.load(config.rstrip(",:"))
    return [f"--config.total_steps={steps}", f"--config.optim.lr={float(base.optim.lr) * LR_FACTOR:g}",
            f"--config.optim.warmup_steps={min(int(base.optim.warmup_steps), max(steps // 10, 1))}",
            f"--config.eval_every={-(-steps // 5)}", f"--config.checkpoint_every={steps}"]


def run(args):
    sides = plan(args)
    root = trained.sweep_workdir(args)
    results = {}
    for side, p in sides.items():
        if side == "bert":
            local.prepare("docstrings")        # once, before runs that would each build it at once
        source_config, source_flags = p["source"]
        source = trained.run_sweep(source_config, root / side / "source", args.parallel, source_flags)
        if len(source) != 1:
            raise trained.SweepError(f"{root / side / 'source'}: expected one source run, found {len(source)}")
        config, flags = p["uptrain"]
        runs = trained.run_sweep(config, root / side / "uptrain", args.parallel,
                                 [f"--config.model.init_from=run:{source[0].workdir.resolve()}", *flags])
        results[side] = {**p, "source_run": source[0], "runs": runs,
                         "settings": trained.by_setting(runs, _label, p["metric"])}
    return _report(results)


def day0(run, metric: str) -> float:
    """The run's evaluation before its first step (job.run evaluates a run with init_from at step 0)."""
    points = dict(trained.curve(run, metric))
    if 0 not in points:
        raise trained.SweepError(f"run {run.name} has no step-0 {metric!r}: was it started from a source?")
    return points[0]


def side_stats(settings: dict, metric: str) -> dict:
    """{label: {"day0": Stat, "final": Stat}} over each setting's seeds."""
    return {k: {"day0": trained.Stat(tuple(day0(r, metric) for r in e["runs"])), "final": e["stat"]}
            for k, e in settings.items()}


def _rows(side: str, settings: dict, stats: dict) -> list[list]:
    ref = stats.get("softmax")
    rows = []
    for k in sorted(stats, key=lambda k: -stats[k]["final"].mean):
        delta = None
        if ref is not None and k != "softmax":
            diff, se = trained.difference(stats[k]["final"], ref["final"])
            delta = f"{100 * diff:+.1f} ± {100 * se:.1f}"
        speed = [r.summary["steps_per_second"] for r in settings[k]["runs"]
                 if r.summary and r.summary.get("steps_per_second") is not None]
        rows.append([SIDE_NAMES[side], k, stats[k]["day0"].text(), stats[k]["final"].text(), delta,
                     f"{sum(speed) / len(speed):.2g}" if speed else None, stats[k]["final"].n])
    return rows


def _report(results: dict) -> Report:
    rows, comparisons, checks, notes, figures = [], [], [], [], {}
    all_stats = {}
    for side, r in results.items():
        settings, metric, seeds, steps = r["settings"], r["metric"], r["seeds"], r["steps"]
        stats = all_stats[side] = side_stats(settings, metric)
        name = SIDE_NAMES[side]
        rows += _rows(side, settings, stats)
        source = r["source_run"]
        source_value = trained.final_metric(source, metric)
        text, ok = trained.complete(settings, r["asked"], r["runs"], seeds, metric)
        checks.append((f"{name}: {text}", ok))
        weak_source = side == "bert" and source_value < SOURCE_MIN_MLM
        if side == "bert":
            checks.append((f"{name}: the source reaches {100 * source_value:.1f} % masked-token accuracy, at least "
                           f"the {100 * SOURCE_MIN_MLM:.0f} % the protocol asks of it ({source.summary.get('step')} "
                           "steps)", not weak_source))
        ref = stats.get("softmax")
        if ref is not None:
            chance = trained.Stat((CHANCE[side],) * 2)
            v, z = trained.rate(ref["final"], chance)
            comparisons.append((f"{name}, task check: the softmax source continued {steps} steps "
                                f"({ref['final'].text()} %) above chance ({100 * CHANCE[side]:g} %) "
                                f"(z = {z:.1f})", v))
            rf = [k for k in stats if k != "softmax"]
            if rf:
                weakest = min(rf, key=lambda k: stats[k]["final"].mean)
                v, z = trained.rate(ref["final"], stats[weakest]["final"])
                comparisons.append((f"{name}, task check: softmax above the weakest uptrained setting after {steps} "
                                    f"steps, {weakest} ({stats[weakest]['final'].text()} %), picked as the "
                                    f"lowest mean of {len(rf)} (which favours agreement) (z = {z:.1f})", v))
        caveat = " (a source below the protocol's masked-token accuracy: read with care)" if weak_source else ""
        # the papers report their claims after uptraining; day 0 is favor's own measure of what a kind inherits
        whens = [(f"after {steps} steps", "final", True), ("day 0", "day0", False)]
        for better, worse, source_text, paper_sides in PAPER_CLAIMS:
            if better in stats and worse in stats:
                for when, key, papers in whens:
                    a, b = stats[better][key], stats[worse][key]
                    v, z = trained.rate(a, b)
                    whose = (source_text if side in paper_sides else f"{source_text}, here on the {name}") if papers \
                        else "favor's check of what each kind inherits before any step, not a figure of the paper"
                    comparisons.append((f"{name}, {when}: {better} ({a.text()} %) > {worse} ({b.text()} %) — "
                                        f"{whose}{caveat} (z = {z:.1f})", v))
        spec = " ".join(str(x) for x in r["uptrain"][1])
        status = source.sweep_status or {}
        took = (f", {(status['ended'] - status['started']) / 60:.0f} min"
                if status.get("started") is not None and status.get("ended") is not None else "")
        notes.append(f"{name}: source `{trained.checkout_spec(r['source'][0])}` ({source.summary.get('step')} steps, "
                     f"{'masked-token ' if side == 'bert' else ''}{metric} {100 * source_value:.1f} %{took}); "
                     f"uptraining sweep `{trained.checkout_spec(r['uptrain'][0])}`{' with ' + spec if spec else ''}, "
                     f"from `--config.model.init_from=run:<source>`" + trained.timing(r["runs"]) + ".")
        if "FAVOR+" in stats and "FAVOR++" in stats and side == "vit":
            notes.append(f"{name}, CRT Fig. 4's stability: the sd over seeds after {steps} steps is "
                         f"{100 * stats['FAVOR++']['final'].sd:.1f} points for FAVOR++ and "
                         f"{100 * stats['FAVOR+']['final'].sd:.1f} for FAVOR+ ({seeds} seeds do not rate a ratio "
                         "of variances: shown, not rated).")
        figures[side] = {"source": {"config": trained.checkout_spec(r["source"][0]), "steps": source.summary.get("step"),
                                    metric: source_value},
                         "uptrain": {"config": trained.checkout_spec(r["uptrain"][0]), "flags": list(r["uptrain"][1]),
                                     "steps": steps, "seeds": seeds},
                         "settings": {k: {"day0": list(s["day0"].values), "final": list(s["final"].values),
                                          "runs": [run.name for run in settings[k]["runs"]],
                                          "curves": {run.name: trained.curve(run, metric)
                                                     for run in settings[k]["runs"]}}
                                      for k, s in stats.items()}}

    def plot(fig):
        _plot(fig, results, all_stats)

    return Report(title=f"{NAME}: softmax models uptrained as each kind, day 0 and after K steps",
                  protocol=PROTOCOL, columns=["model", "setting", "day 0 (%)", "after K steps (%)",
                                              "Δ vs softmax after K (± SE)", "steps/s", "seeds"],
                  rows=rows, figures=figures, plot=plot, checks=checks, comparisons=comparisons, notes=notes,
                  figsize=(15, 5.2 * len(results)))


def _plot(fig, results, all_stats):
    import matplotlib
    colours = matplotlib.colormaps["tab10"]
    axes = fig.subplots(len(results), 2, squeeze=False, width_ratios=[1, 1.1])
    for (side, r), (ax_curve, ax_dots) in zip(results.items(), axes):
        stats, metric, steps = all_stats[side], r["metric"], r["steps"]
        order = sorted(stats, key=lambda k: -stats[k]["final"].mean)
        colour = {k: "black" if k == "softmax" else colours(i % 10) for i, k in enumerate(stats)}
        for k in stats:
            xs, mean, sd = trained.mean_curve(r["settings"][k]["runs"], metric)
            ax_curve.plot(xs, 100 * mean, marker="o", ms=3, color=colour[k], label=k, lw=2 if k == "softmax" else 1)
            ax_curve.fill_between(xs, 100 * (mean - sd), 100 * (mean + sd), color=colour[k], alpha=0.12)
        ax_curve.axhline(100 * CHANCE[side], color="grey", ls=":", lw=1, label=f"chance ({100 * CHANCE[side]:g} %)")
        ax_curve.set_xlabel("uptraining step (0: before any step)")
        ax_curve.set_ylabel(f"eval {metric} (%), mean over seeds ± sd")
        ax_curve.set_title(f"{SIDE_NAMES[side]}: uptraining from the softmax source")
        ax_curve.grid(alpha=0.3)
        ax_curve.legend(fontsize=7, loc="lower right")
        ys = np.arange(len(order))[::-1]
        for y, k in zip(ys, order):
            for key, face, dy in (("day0", "white", 0.15), ("final", colour[k], -0.15)):
                s = stats[k][key]
                se = s.sd / math.sqrt(s.n) if s.n > 1 else 0.0
                ax_dots.errorbar(100 * s.mean, y + dy, xerr=200 * se, fmt="o", mfc=face, mec=colour[k],
                                 color=colour[k], ms=7, capsize=3)
                ax_dots.plot([100 * v for v in s.values], [y + dy] * s.n, "k.", ms=3)
        ax_dots.axvline(100 * CHANCE[side], color="grey", ls=":", lw=1)
        ax_dots.set_yticks(ys, order, fontsize=8)
        ax_dots.set_xlabel(f"eval {metric} (%): ○ day 0, ● after {steps} steps; mean ± 2 SE, seeds as dots")
        ax_dots.set_title(f"{SIDE_NAMES[side]}: day 0 against after {steps} steps (best last-step first)")
        ax_dots.grid(alpha=0.3, axis="x")
    fig.suptitle("Softmax models continued as each attention kind (the softmax row continues the source unchanged)")
