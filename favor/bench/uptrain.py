"""`python -m favor.bench uptrain`: how well each attention kind inherits a softmax model.

For a config (default: the digits ViT of configs/default.py), train a softmax source run (or reuse the
one in --workdir), then for every kind:
  day 0       the source's parameters evaluated with the kind, no training (mean ± sd over --draws
              feature draws: the run's seed picks its evaluation ω);
  uptrain     K = --steps steps of the ordinary loss from the source's parameters;
  + transfer  the same K steps, of which the first T = --transfer_steps are attention transfer
              (favor.uptrain.transfer: the query/key projections learn to imitate the softmax attention);
  scratch     the kind trained from a fresh initialisation for the same K steps.
Every run goes through job.run exactly as train.py would (in this process). Writes a table to
BENCHMARKS.md (section uptrain-<config name>), the raw figures to bench/<section>.json and a plot
(the metric against step, one line per kind, one panel per way of starting) to bench/<section>.png.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from functools import partial
from pathlib import Path

import jax

from favor import attention, strings
from favor.attention import schedule
from favor.bench import sections
from favor.bench.common import specs

LOWER_IS_BETTER = ("loss", "perplexity", "wer", "cer")
KINDS = ("favor+", "favor++", "favor#", "favor#:saderf", "hrf", "simrf", "favor", "relu", "elu")


def _config(spec, flags, kind, **overrides):
    """The config `spec` (a configs/*.py[:args]) with command-line style `flags`, the attention kind
    (kind[:variant]) and `overrides` (dotted keys) applied, validated as train.py would."""
    from favor.config import loading          # the training stack loads when this subcommand runs (cli.py)
    config = loading.load(spec)
    for flag in flags:
        try:
            loading.apply_flag(config, flag)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    name, options = attention.parse_spec(kind)
    with config.unlocked():
        config.model.attention.kind = name
        for key, value in options.items():
            config.model.attention[key] = value
    for key, value in overrides.items():
        _set(config, key, value)
    return config


def _set(config, key, value):
    node = config
    *path, last = key.split(".")
    for p in path:
        node = node[p]
    with config.unlocked():
        node[last] = value


def _run(config, workdir, log):
    """job.run(config, workdir), or the summary of a run that finished there before (an interrupted
    benchmark reruns only what it lacks; a finished run's summary holds its whole eval curve)."""
    from favor import job            # the training stack loads when this subcommand runs (cli.py)
    done = Path(workdir) / "summary.json"
    if done.exists():
        summary = json.loads(done.read_text())
        if summary.get("step") == int(config.total_steps) and not summary.get("preempted"):
            log(f"  {workdir.name}: reused")
            return summary
    t0 = time.perf_counter()
    summary = job.run(config, workdir)
    log(f"  {workdir.name}: {time.perf_counter() - t0:.0f} s")
    return summary


def measure(spec, flags, kinds, steps, transfer_steps, draws, workdir, metric, source_steps=None, lr_factor=0.25,
            log=print, on_kind=None):
    """The figures of the benchmark (a dict, also what bench/<section>.json holds)."""
    workdir = Path(workdir)
    src_dir = workdir / "softmax-source"
    over = {} if source_steps is None else {"total_steps": source_steps}
    source_cfg = _config(spec, flags, "softmax", **over)
    log(f"softmax source: {src_dir}")
    source = dict(_run(source_cfg, src_dir, log))
    every = max(steps // 5, 1)
    # warmup capped at a tenth of the run (the source config's is sized for its own length)
    common = {"total_steps": steps, "eval_every": every, "checkpoint_every": steps or 1,
              "optim.warmup_steps": min(int(source_cfg.optim.warmup_steps), max(steps // 10, 1))}
    # uptraining continues a trained model: its peak learning rate is `lr_factor` of the from-scratch one
    # (fine-tuning practice; the full rate undoes much of what the model inherits)
    uptrain_lr = {"optim.lr": float(source_cfg.optim.lr) * lr_factor}
    results = {"source": {"steps": source_cfg.total_steps, metric: source[metric]}, "kinds": {}}
    for kind in kinds:
        log(f"{kind}:")
        tag = kind.replace(":", "-").replace("+", "p").replace("#", "sharp")
        row = {}
        c = _config(spec, flags, kind, total_steps=0, **{"model.init_from": f"run:{src_dir}"})
        cached = workdir / f"{tag}-day0.json"          # an interrupted benchmark keeps what it measured
        row["day0"] = json.loads(cached.read_text()) if cached.exists() else []
        if len(row["day0"]) != draws:
            t0 = time.perf_counter()
            row["day0"] = [m[metric] for m in day0(c, workdir / f"{tag}-day0", range(draws))]
            cached.write_text(json.dumps(row["day0"]))
            log(f"  day 0, {draws} draws: {time.perf_counter() - t0:.0f} s")
        start = {"model.init_from": f"run:{src_dir}", **uptrain_lr}
        for name, over in (("uptrain", start), ("transfer", {**start, "uptrain.transfer_steps": transfer_steps}),
                           ("scratch", {})):
            c = _config(spec, flags, kind, **common, **over)
            s = _run(c, workdir / f"{tag}-{name}", log)
            row[name] = {"final": s[metric], "curve": [(e["step"], e[metric]) for e in s["eval_history"]]}
            if "attention_mse" in s:
                row[name]["attention_mse"] = s["attention_mse"]
        results["kinds"][kind] = row
        if on_kind is not None:
            on_kind(results)
    return results


def day0(config, workdir, seeds, batches=None):
    """The eval metrics of `config`'s model (init_from a source) before any step, once per seed in
    `seeds` (the seed picks the evaluation ω, as job.run's evaluation does: the first equals a
    `total_steps=0` run's), over the first `batches` evaluation batches (None: the whole split). The
    model is loaded and the evaluation compiled once for all draws."""

    from favor import job                       # the training stack: as in _config
    from favor.train import steps
    config, source, task, model, layout, state = job.rebuild(config, workdir)
    step_fn = jax.jit(partial(steps.eval_step, graphdef=model.graphdef, task=task), out_shardings=layout.replicated)
    draw = jax.jit(lambda p, r, key: steps.with_features(p, r, graphdef=model.graphdef, key=key))
    redraws = schedule.parse(attention.block_redraw(config.model.attention)).redraws
    out = []
    for seed in seeds:
        key = jax.random.fold_in(jax.random.PRNGKey(int(seed)), job.EVAL_FEATURES_STREAM)
        data = itertools.islice(source.eval_batches(int(config.eval_batch_size)), batches)
        out.append(steps.evaluate(state, (layout.global_batch(b) for b in data), step_fn=step_fn, finalize=task.finalize,
                                    features_fn=(lambda p, r: draw(p, r, key)) if redraws else None))
    return out


def _mean_sd(xs):
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def table(results, metric, steps, transfer_steps, draws) -> str:
    pct = lambda v: f"{100 * v:.1f}" if metric == "accuracy" else f"{v:.4g}"
    src = results["source"][metric]
    head = (f"| kind | day 0 (mean ± sd, {draws} draws) | uptrain {steps} steps | transfer {transfer_steps} + "
            f"{steps - transfer_steps} steps | attention MSE before → after transfer | from scratch {steps} steps |")
    rows = [head, "|---|---|---|---|---|---|",
            f"| softmax (source, {results['source']['steps']} steps) | {pct(src)} | | | | |"]
    for kind, r in results["kinds"].items():
        m, sd = _mean_sd(r["day0"])
        mse = r["transfer"].get("attention_mse", {})
        before, after = mse.get("0"), mse.get(str(transfer_steps))
        mse_txt = (f"{statistics.fmean(before):.3g} → {statistics.fmean(after):.3g}" if before and after else "")
        rows.append(f"| {kind} | {pct(m)} ± {pct(sd)} | {pct(r['uptrain']['final'])} | {pct(r['transfer']['final'])} "
                    f"| {mse_txt} | {pct(r['scratch']['final'])} |")
    return "\n".join(rows)


def plot(results, metric, path, title, transfer_steps=None):
    # plotting loads matplotlib only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (("uptrain", "uptrained from the softmax run"), ("transfer", "attention transfer, then uptrained"),
              ("scratch", "trained from scratch"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), sharey=True)
    cmap = plt.get_cmap("tab10")
    scale = 100.0 if metric == "accuracy" else 1.0
    for ax, (key, name) in zip(axes, panels):
        for i, (kind, r) in enumerate(results["kinds"].items()):
            steps, values = zip(*r[key]["curve"])
            ax.plot(steps, [scale * v for v in values], marker="o", ms=3, color=cmap(i % 10), label=kind)
        ax.axhline(scale * results["source"][metric], color="black", ls="--", lw=1, label="softmax source")
        if key == "transfer" and transfer_steps:
            ax.axvline(transfer_steps, color="grey", ls=":", lw=1)
            ax.annotate("end of transfer", (transfer_steps, 0.02), xycoords=("data", "axes fraction"),
                        fontsize=8, color="grey", ha="left")
        ax.set_title(name)
        ax.set_xlabel("training step of this run")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"eval {metric}" + (" (%)" if metric == "accuracy" else ""))
    if metric == "perplexity":      # day 0 and from-scratch start orders of magnitude above the source
        axes[0].set_yscale("log")
    axes[-1].legend(loc="upper right" if metric in LOWER_IS_BETTER else "lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args, flags, argv, parser):
    kinds = specs(parser, "--kinds", args.kinds)
    if args.transfer_steps > args.steps:
        raise SystemExit(f"--transfer_steps {args.transfer_steps} must be at most --steps {args.steps}")
    path, config_arg = strings.config_spec(args.config)
    name = Path(path).stem + (f"-{config_arg}" if config_arg else "")
    section = args.section or f"uptrain-{name}".replace("=", "-").replace(",", "-")
    workdir = Path(args.workdir or Path(args.out) / "bench" / "runs" / section)
    t0 = time.perf_counter()
    # the table, plot and JSON are rewritten after every kind, so a long benchmark shows what it has
    write_all = lambda results: write(args, argv, results, section, name, time.perf_counter() - t0)
    results = measure(args.config, flags, kinds, args.steps, args.transfer_steps, args.draws, workdir, args.metric,
                      args.source_steps, args.lr_factor, on_kind=write_all)
    print(table(results, args.metric, args.steps, args.transfer_steps, args.draws))
    return results


def write(args, argv, results, section, name, wall):
    out = Path(args.out) / "bench"
    out.mkdir(parents=True, exist_ok=True)
    meta = sections.machine(argv, seconds=wall, metric=args.metric, steps=args.steps,
                            transfer_steps=args.transfer_steps, draws=args.draws, lr_factor=args.lr_factor)
    title = (f"{name}: {args.metric} of each attention kind started from a softmax run "
             f"({results['source']['steps']} steps, {100 * results['source'][args.metric]:.1f} %)"
             if args.metric == "accuracy" else f"{name}: {args.metric} per attention kind from a softmax run ("
             f"{results['source']['steps']} steps, {results['source'][args.metric]:.4g}"
             f"{'; lower is better' if args.metric in LOWER_IS_BETTER else ''})")
    plot(results, args.metric, out / f"{section}.png", title, args.transfer_steps)
    body = (f"{sections.heading(section, meta)}\n\n"
            f"{sections.where(meta)}; {wall / 60:.0f} min for this "
            f"invocation (runs it reused from an earlier one not counted). "
            f"Eval {args.metric} ({'%' if args.metric == 'accuracy' else 'value'}) of each kind started from a "
            f"softmax run's parameters: day 0 (no training), after {args.steps} steps of uptraining without and "
            f"with {args.transfer_steps} steps of attention transfer first (mean per-layer attention MSE against "
            f"the softmax teacher on the eval split, before → after the transfer), and the kind trained from "
            f"scratch for the same {args.steps} steps (the config's optimizer; uptraining at {args.lr_factor}× its "
            f"peak learning rate; warmup at most a tenth of the run). One run per cell but day 0. "
            f"Plot: bench/{section}.png; "
            f"raw figures: bench/{section}.json.\n\n" + table(results, args.metric, args.steps, args.transfer_steps,
                                                             args.draws))
    sections.publish(args.out, section, body, {"meta": meta, **results})


def add_parser(sub):
    u = sub.add_parser("uptrain", help="every kind started from a softmax run: day 0, uptrained, with attention "
                                       "transfer, from scratch (flags after -- go to the config)")
    u.add_argument("--config", default="configs/default.py", help="configs/<file>.py[:args]")
    u.add_argument("--kinds", default=",".join(KINDS))
    u.add_argument("--steps", type=int, default=300, help="steps of each uptraining and from-scratch run")
    u.add_argument("--transfer_steps", type=int, default=100, help="of those, attention transfer first")
    u.add_argument("--source_steps", type=int, default=None, help="the softmax source run's steps (default: "
                                                                  "the config's total_steps)")
    u.add_argument("--draws", type=int, default=5, help="feature draws of each day-0 evaluation")
    u.add_argument("--metric", default="accuracy")
    u.add_argument("--lr_factor", type=float, default=0.25, help="uptraining's peak learning rate as a fraction "
                                                                 "of the config's (from scratch: the config's)")
    u.add_argument("--workdir", default=None, help="where the runs go (the source run is reused from here); "
                                                   "default bench/runs/<section>")
    u.add_argument("--out", default=".")
    u.add_argument("--section", default=None)
    return u
