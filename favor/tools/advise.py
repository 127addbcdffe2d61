"""Which kernel should I use? `python -m favor.tools.advise --workdir <run | hf:dir> [--config ...]
[--length L] [--kinds favor+,favor#] [--num_features 64,256] [--bands 0,16] [--out DIR]`.

On your model and a few of its evaluation batches, for each setting (kind, feature width, softmax band):
- day 0: the task's metric with the setting's attention in place of the model's, no training step
  (mean ± sd over `--draws` feature draws; deterministic maps once): what the setting inherits;
- the attention error layer by layer: ‖Y − Y_softmax‖ / ‖Y_softmax‖ on the model's own queries, keys
  and values (favor.tools.inspect), the mean and the worst layer in the table;
- the cost at your sequence length against softmax, forward and forward+backward of one attention
  layer of your model's shape (batch 1), timed round-robin on this machine (a program whose planned
  memory exceeds half of it is not run);
- for a causal model, the decoding state each setting carries against softmax's cache at that length.
It prints one ranked table (best day 0 first) and a recommendation with its reason, and writes
advise.json and advise.png to `--out`.

The recommendation is the cheapest setting (forward+backward time) among those whose day 0 is within
`--tolerance` of the best one's (1 point of accuracy, 2 % of perplexity or loss): a setting worth
uptraining from, at the least cost. Day 0 is what
a kind inherits before any step, not where it ends: the README's "Choosing a kernel" says what favor
measured after training.

A favor run (`--workdir runs/x`) brings its own config. A Hugging Face directory (`--workdir hf:<dir>`)
needs the config of the task to evaluate it on, with the checkpoint's sizes (`--config
configs/decoder_lm.py:init=<dir>,data=local` takes them from the checkpoint); flags after it
(`--config.data.max_length=256`) go to that config.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_KINDS = ("favor+", "favor++", "favor#", "simrf", "relu", "elu")
DEFAULT_BAND = 16                       # a causal model's candidates also try exact softmax over this band
METRICS = ("wer", "perplexity", "accuracy", "loss")    # the first the task reports is ranked on (an LM: perplexity)


@dataclass
class Setting:
    """One candidate: a kind spec (with its options), a feature width (None: the kind has none, or the
    run's) and a band of exact softmax around the diagonal (0: none)."""
    spec: str
    kind: str
    options: dict
    features: int | None
    band: int
    label: str = ""
    figures: dict = field(default_factory=dict)

    def block(self) -> dict:
        """The attention block keys this setting sets on the model's."""
        out = {"kind": self.kind, **self.options}
        if self.features is not None:
            out["num_features"] = self.features
        if self.band:
            out["window"] = self.band
        return out

    def spec_with_band(self) -> str:
        return self.spec.split("@")[0] + (f"@{self.band}" if self.band else "")


def settings_for(kinds_text, widths, bands, run_block, causal) -> list[Setting]:
    """The candidates: softmax (the reference) and every kind of `kinds_text` at each width (kinds that take
    one; the others have none) with each band (a band in a spec is that spec's only one). Defaults:
    the run's width (64 when it has none) and 4× it; bands 0 and 16 for a causal model, 0 otherwise
    (exact attention near the diagonal is what a causal LM's local dependencies need: the linearize
    reproduction)."""
    from favor import attention
    parsed = attention.parse_specs("--kinds", kinds_text)
    if widths is None:
        own = int(run_block.get("num_features") or 0) or 64
        widths = [own, 4 * own]
    if bands is None:
        bands = [0, DEFAULT_BAND] if causal else [0]
    out = [Setting("softmax", "softmax", {}, None, 0)]
    for spec, kind, options in parsed:
        if kind == "softmax":
            continue
        band_in_spec = int(options.pop("window", 0) or 0)
        ws = list(widths) if "num_features" in attention.get(kind).OPTIONS else [None]
        spec = spec.split("@")[0]
        for w in ws:
            for b in ([band_in_spec] if band_in_spec else bands):
                out.append(Setting(spec, kind, dict(options), w, int(b)))
    seen, unique = set(), []
    for s in out:
        s.label = s.spec + (f" F={s.features}" if s.features else "") + (f" + band {s.band}" if s.band else "")
        if s.label not in seen:
            seen.add(s.label)
            unique.append(s)
    return unique


def _with_block(config, setting: Setting):
    """A copy of `config` whose attention block is the setting's (the model's other attention options,
    qk_norm included, kept). A random-feature setting other than the model's own redraws its features
    for each evaluation draw (a run trained with one fixed ω keeps only its own kind's)."""
    from favor.config import blocks
    c = config.copy_and_resolve_references()
    block = setting.block()
    with c.unlocked():
        # the model's own band and spec options (FAVOR#'s variant, ...) are its kind's, not the setting's:
        # a spec without them means no band and the setting's kind's own
        c.model.attention["window"] = setting.band
        for key in blocks.SPEC_OPTIONS:
            if key in c.model.attention:
                c.model.attention[key] = block.get(key, "")
        for key, value in block.items():
            c.model.attention[key] = value
        if "redraw" in c.model.attention and _block_of(c) != _block_of(config):
            c.model.attention["redraw"] = "step"
    return c


def _block_of(config) -> dict:
    """The attention block as its kind takes it (options a kind does not take dropped)."""
    from favor import attention
    return attention.block_options(dict(config.model.attention))


def source_config(workdir: str, config_spec: str | None, flags):
    """(config starting from the model `workdir` names, the directory models are rebuilt in, a temporary
    directory to remove or None). A run brings its own config; a Hugging Face directory needs one."""
    from favor.config import loading
    from favor.tools import inspect
    if workdir.startswith("hf:"):
        if not Path(workdir[3:]).expanduser().is_dir():
            raise ValueError(f"--workdir {workdir}: {workdir[3:] or '(empty)'} is not a directory (hf:<dir> names a "
                             "Hugging Face model directory with config.json)")
        if not config_spec:
            raise ValueError(f"--workdir {workdir}: a Hugging Face model needs --config, the task to evaluate "
                             "it on with the checkpoint's sizes (e.g. configs/decoder_lm.py:init=<dir>,data=local)")
        config = loading.load(config_spec)
        for flag in flags:
            loading.apply_flag(config, flag)
        with config.unlocked():
            config.model.init_from = workdir
            if "uptrain" in config:
                config.uptrain.transfer_steps = 0
        scratch = tempfile.mkdtemp(prefix="favor-advise-")
        return config, Path(scratch), scratch
    if config_spec or flags:
        raise ValueError(f"--workdir {workdir}: a favor run brings its own config; --config and config flags "
                         "are for a Hugging Face directory (hf:<dir>)")
    path = Path(workdir)
    if not (path / "checkpoints").is_dir():
        raise ValueError(f"--workdir {workdir}: not a favor run (no checkpoints/ there) nor hf:<dir> (a Hugging "
                         "Face model directory)")
    return inspect.run_config(path), path.absolute(), None


def day0(config, workdir, setting: Setting, draws, batches, log):
    """The setting's evaluation metrics per draw (a list of dicts), the model rebuilt with its attention:
    one evaluation for a setting whose features are not redrawn (a deterministic map, the model's own
    fixed ω)."""
    from favor import attention
    from favor.attention import schedule
    from favor.bench import uptrain as bench_uptrain
    c = _with_block(config, setting)
    redraws = schedule.parse(attention.block_redraw(c.model.attention)).redraws
    random = isinstance(attention.get(setting.kind), attention.RandomFeatureAttention)
    setting.figures["day0"] = bench_uptrain.day0(c, workdir, range(draws if random and redraws else 1),
                                                 batches=batches)
    log(f"day 0: {setting.label}")


def pick_metric(evaluated: dict, asked: str | None) -> str:
    if asked:
        if asked not in evaluated:
            raise ValueError(f"--metric {asked!r}: the task reports {', '.join(sorted(evaluated))}")
        return asked
    for m in METRICS:
        if m in evaluated:
            return m
    raise ValueError(f"the task reports none of {', '.join(METRICS)} (it reports {', '.join(sorted(evaluated))}): "
                     "pass --metric")


def costs(config, settings, shape, causal, rounds, seed, log):
    """Per setting {"fwd": [s per round], "grad": [...]} of one attention layer at `shape` (B, L, H, D),
    timed round-robin; a program whose planned peak memory exceeds half the machine's is left out
    (its entry says so)."""
    import jax
    from favor.bench import common
    from favor.tools import inspect
    b, length, h, d = shape
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k, v = (0.5 * jax.random.normal(kk, shape) for kk in ks[:3])
    programs, skipped = {}, {}
    budget = common.memory_budget()
    for s in settings:
        attn = inspect.attention_of(_with_block(config, s).model.attention)
        stats = attn.statistics(q, k) if causal and getattr(attn, "data_dependent", False) else None
        for grad in (False, True):
            name = (s.label, "grad" if grad else "fwd")
            compiled, peak, _ = common.compile_fn(common.layer_fn(attn, causal, stats, grad), (q, k, v, ks[3]))
            if peak is not None and peak > budget:
                skipped[name] = peak
                continue
            programs[name] = (compiled, (q, k, v, ks[3]), 1.0)
        log(f"compiled: {s.label}")
    times = common.round_robin(programs, rounds, seed)
    for s in settings:
        s.figures["seconds"] = {mode: times.get((s.label, mode)) for mode in ("fwd", "grad")}
        s.figures["skipped_bytes"] = {mode: skipped[(s.label, mode)] for mode in ("fwd", "grad")
                                      if (s.label, mode) in skipped}


def state_bytes(config, setting: Setting, length: int) -> int:
    """Bytes of the decoding state the model carries for one sequence of up to `length` tokens with the
    setting's attention: every layer's cache as the decoder's own prefill leaves it (shapes only,
    nothing computed)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from favor import job
    build, _ = job.model_builder(_with_block(config, setting))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build()))
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)       # a one-token prompt; the cache holds `length` tokens
    caches = jax.eval_shape(lambda st, ids: nnx.merge(graphdef, st).prefill(ids, length)[1], state, ids)
    return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(caches)))


def _stat(values):
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, sd, len(values)


def summarise(settings, metric, tolerance, length, causal) -> dict:
    """The ranked rows and the recommendation, from the settings' measured figures only."""
    from favor.tools.report import lower_is_better
    lower = lower_is_better(metric)
    ref = settings[0]
    assert ref.kind == "softmax"
    rows = []
    for s in settings:
        mean, sd, n = _stat([m[metric] for m in s.figures["day0"]])
        err = s.figures.get("relative_error")
        secs = s.figures["seconds"]
        ratio = {mode: (statistics.median(a / r for a, r in zip(secs[mode], ref.figures["seconds"][mode]))
                        if secs[mode] and ref.figures["seconds"][mode] else None) for mode in ("fwd", "grad")}
        rows.append({"setting": s.label, "spec": s.spec_with_band(), "features": s.features, "band": s.band,
                     "day0": mean, "day0_sd": sd, "draws": n,
                     "error_mean": None if err is None else float(sum(map(sum, err)) / sum(map(len, err))),
                     "error_worst_layer": None if err is None else max(sum(r) / len(r) for r in err),
                     "fwd_ratio": ratio["fwd"], "grad_ratio": ratio["grad"],
                     "fwd_ms": None if not secs["fwd"] else 1e3 * min(secs["fwd"]),
                     "grad_ms": None if not secs["grad"] else 1e3 * min(secs["grad"]),
                     "state_bytes": s.figures.get("state_bytes")})
    sign = 1.0 if lower else -1.0
    rows.sort(key=lambda r: (sign * r["day0"], _cost(r)))
    soft = next(r for r in rows if r["setting"] == "softmax")
    others = [r for r in rows if r["setting"] != "softmax"]
    out = {"metric": metric, "lower_is_better": lower, "length": length, "causal": causal, "rows": rows,
           "softmax": soft, "tolerance": tolerance}
    if not others:
        out["recommendation"] = None
        return out
    best = others[0]

    # a tie is a practical one (the tolerance), not "within 2 standard errors": with three draws a
    # setting whose day 0 swings by ten points between draws would tie with everything, and that swing
    # is itself a reason not to pick it
    def tied(r):
        return abs(r["day0"] - best["day0"]) <= tolerance * (abs(best["day0"]) if lower else 1.0) + 1e-12

    close = [r for r in others if tied(r)]
    timed = [r for r in close if r["grad_ms"] is not None]
    pick = min(timed, key=_cost) if timed else best
    out["recommendation"] = pick["setting"]
    out["tied"] = [r["setting"] for r in close]
    out["reason"] = reason(pick, best, soft, close, metric, lower, tolerance, length, timed=bool(timed))
    return out


def _cost(row) -> float:
    """A row's forward+backward cost for choosing among settings: its ratio to softmax's, or — where
    softmax's program did not fit in memory and no ratio exists — its own time (the same order)."""
    if row["grad_ratio"] is not None:
        return row["grad_ratio"]
    return row["grad_ms"] if row["grad_ms"] is not None else math.inf


def _metric_text(value, metric, sd=False):
    if metric == "accuracy":
        return f"{100 * value:.1f} %"
    return f"{value:.2g}" if sd else f"{value:.4g}"


def _delta_text(value, ref, metric, lower):
    if metric == "accuracy":
        return f"{100 * (value - ref):+.1f} points"
    if ref == 0:                                   # no relative change from zero: the difference itself
        return f"{value - ref:+.4g}"
    return f"{100 * (value / ref - 1):+.1f} %"


def reason(pick, best, soft, close, metric, lower, tolerance, length, timed=True) -> str:
    parts = [f"{pick['setting']}: day 0 {metric} {_metric_text(pick['day0'], metric)} against softmax's "
             f"{_metric_text(soft['day0'], metric)} ({_delta_text(pick['day0'], soft['day0'], metric, lower)})"]
    if pick["grad_ratio"] is not None:
        parts.append(f"{pick['grad_ratio']:.2g}× softmax's forward+backward time at L = {length}")
    elif pick["grad_ms"] is not None:
        parts.append(f"{pick['grad_ms']:.3g} ms forward+backward at L = {length}, where softmax's program did not "
                     "fit in half this machine's memory")
    tol = f"{100 * tolerance:g} {'%' if lower else 'point'}{'' if lower or tolerance == 0.01 else 's'}"
    if not timed:
        parts.append(f"the best day 0 ({len(close)} within {tol} of it; none of them could be timed)")
    elif pick is best and len(close) == 1:
        parts.append(f"the best day 0, and no other setting within {tol} of it")
    elif pick is best:
        parts.append(f"the best day 0 and the cheapest of the {len(close)} settings within {tol} of it")
    else:
        parts.append(f"the cheapest of the {len(close)} settings within {tol} of the best day 0 "
                     f"({best['setting']}, {_metric_text(best['day0'], metric)})")
    if pick["grad_ratio"] is not None and pick["grad_ratio"] > 1:
        parts.append(f"at L = {length} softmax itself is faster: linear attention pays at longer sequences "
                     "(--length L measures yours)")
    return "; ".join(parts)


def table(summary) -> str:
    metric = summary["metric"]
    causal = summary["causal"]
    head = ["rank", "setting", f"day 0 {metric}", "Δ vs softmax", "attn error mean / worst layer",
            "fwd × softmax", "fwd+bwd × softmax"] + (["decoding state"] if causal else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    soft = summary["softmax"]
    for i, r in enumerate(summary["rows"], 1):
        day0 = _metric_text(r["day0"], metric) + (f" ± {_metric_text(r['day0_sd'], metric, sd=True)}"
                                                   if r["draws"] > 1 else "")
        delta = "–" if r is soft else _delta_text(r["day0"], soft["day0"], metric, summary["lower_is_better"])
        err = "–" if r["error_mean"] is None else f"{r['error_mean']:.3g} / {r['error_worst_layer']:.3g}"
        ratio = lambda x: "not run (memory)" if x is None else f"{x:.2f}"
        cells = [str(i), r["setting"], day0, delta, err, ratio(r["fwd_ratio"]), ratio(r["grad_ratio"])]
        if causal:
            cells.append("–" if r["state_bytes"] is None else f"{r['state_bytes'] / 2 ** 20:.3g} MiB")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary, layer_errors, path, title):
    """Three panels: day 0 per setting (± sd), the attention error per layer, the cost against softmax."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    rows = summary["rows"]
    metric = summary["metric"]
    scale = 100.0 if metric == "accuracy" else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(18, 1.5 + 0.32 * len(rows) + 3.0), layout="constrained")
    ys = np.arange(len(rows))[::-1]
    names = [r["setting"] for r in rows]
    colours = ["black" if n == "softmax" else ("tab:red" if n == summary.get("recommendation") else "tab:blue")
               for n in names]
    ax = axes[0]
    for y, r, c in zip(ys, rows, colours):           # points, not bars: a log axis has no zero to start from
        ax.errorbar(scale * r["day0"], y, xerr=scale * r["day0_sd"], fmt="o", color=c, ms=7, capsize=3)
    ax.axvline(scale * summary["softmax"]["day0"], color="black", ls="--", lw=1)
    ax.set_yticks(ys, names, fontsize=8)
    ax.set_xlabel(f"day 0 {metric}{' (%)' if metric == 'accuracy' else ''}, mean ± sd over draws\n(dashed: softmax)")
    ax.set_title(f"What each setting inherits\n({'lower' if summary['lower_is_better'] else 'higher'} is better)",
                 fontsize=10)
    if summary["lower_is_better"]:
        ax.set_xscale("log")
    ax.grid(alpha=0.3, axis="x")
    ax = axes[1]
    for y, r, c in zip(ys, rows, colours):
        err = layer_errors.get(r["setting"])
        if err is None or r["setting"] == "softmax":
            continue
        per_layer = [sum(row) / len(row) for row in err]
        ax.plot(sum(per_layer) / len(per_layer), y, "o", color=c, ms=7)
        ax.plot(per_layer, [y] * len(per_layer), "k|", ms=10, mew=1.5)
    ax.set_yticks(ys, names, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("‖Y − Y_softmax‖ / ‖Y_softmax‖\n(●: mean over layers; |: each layer, mean over heads)")
    ax.set_title("Attention error on the model's own inputs\n(lower is better)", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    ax = axes[2]
    width = 0.4
    for j, (mode, text) in enumerate((("fwd_ratio", "forward"), ("grad_ratio", "forward+backward"))):
        vals = [r[mode] if r[mode] is not None else 0.0 for r in rows]
        ax.barh(ys + (0.5 - j) * width, vals, height=width, label=text, color=("tab:green", "tab:purple")[j], alpha=0.75)
    ax.axvline(1.0, color="black", ls="--", lw=1)
    ax.set_yticks(ys, names, fontsize=8)
    ax.set_xlabel(f"time of one attention layer ÷ softmax's, L = {summary['length']}\n(dashed: softmax)")
    ax.set_title("Cost on this machine\n(median of round-robin ratios)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="x")
    for ax in axes:                                  # one row per setting, at the same height in every panel
        ax.set_ylim(-0.7, len(rows) - 0.3)
    fig.suptitle(title + (f"\nrecommended (red): {summary['recommendation']}" if summary.get("recommendation")
                          else ""), fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def advise(workdir, config_spec=None, flags=(), kinds=",".join(DEFAULT_KINDS), widths=None, bands=None, length=None,
           draws=3, batches=4, rounds=5, seed=0, metric=None, tolerance=None, log=print) -> dict:
    """Every figure of the advice (what advise.json holds)."""
    from favor.tools import inspect
    from favor.tools.report import lower_is_better
    config, rebuild_dir, scratch = source_config(workdir, config_spec, list(flags))
    try:
        causal = config.model.name == "decoder"        # favor's causal family: its layers are causal
        settings = settings_for(kinds, widths, bands, dict(config.model.attention), causal)
        day0(config, rebuild_dir, settings[0], draws, batches, log)
        metric = pick_metric(settings[0].figures["day0"][0], metric)      # a bad --metric fails before the rest
        looked = inspect.inspect(rebuild_dir, batches=batches, seed=seed, log=lambda s: None, config=config,
                                 built=[(s.label, inspect.attention_of(_with_block(config, s).model.attention))
                                        for s in settings])
        for s in settings:
            s.figures["relative_error"] = looked["kinds"][s.label]["relative_error"]
        for s in settings[1:]:
            day0(config, rebuild_dir, s, draws, batches, log)
    finally:
        if scratch is not None:
            import shutil
            shutil.rmtree(scratch, ignore_errors=True)
    if tolerance is None:
        tolerance = 0.02 if lower_is_better(metric) else 0.01
    length = int(length or looked["length"])
    shape = (1, length, looked["heads"], looked["head_dim"])
    costs(config, settings, shape, looked["causal"], rounds, seed, log)
    if looked["causal"]:
        for s in settings:
            s.figures["state_bytes"] = state_bytes(config, s, length)
    summary = summarise(settings, metric, tolerance, length, looked["causal"])
    limit = int(config.model.get("max_positions", 0) or 0)
    if limit and length > limit:
        summary["note"] = (f"L = {length} exceeds the model's max_positions ({limit}): the cost and state are a "
                           "model of this shape's at that length, not what this checkpoint can run")
    return {"workdir": str(workdir), "config": config_spec, "metric": metric, "length": length,
            "eval_length": looked["length"], "shape": list(shape), "causal": looked["causal"], "draws": draws,
            "batches": looked["batches"], "rounds": rounds, "layers": looked["layers"], "heads": looked["heads"],
            "summary": summary,
            "settings": {s.label: {"block": s.block(), **{k: v for k, v in s.figures.items()}} for s in settings}}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m favor.tools.advise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="a favor run, or hf:<dir> (a Hugging Face model directory)")
    p.add_argument("--config", default=None, help="configs/<file>.py[:args]: the task a Hugging Face model is "
                                                  "evaluated on (hf: only); --config.<key>=<value> flags follow it")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="kind specs (kind[:variant][@band]), comma- "
                                                                    "or '/'-separated (default: %(default)s)")
    p.add_argument("--num_features", default="", help="feature widths of the random-feature kinds (default: the "
                                                      "run's width, 64 if it has none, and 4× it)")
    p.add_argument("--bands", default="", help="softmax bands to try, 0 for none (default: 0,16 for a causal "
                                               "model, 0 otherwise)")
    p.add_argument("--length", type=int, default=None, help="sequence length the cost is measured at "
                                                            "(default: the evaluation batches')")
    p.add_argument("--draws", type=int, default=3, help="feature draws of each day-0 evaluation (default 3)")
    p.add_argument("--batches", type=int, default=4, help="evaluation batches (default 4)")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds (default 5)")
    p.add_argument("--metric", default=None, help="the metric to rank on (default: wer, perplexity, accuracy "
                                                  "or loss, the first the task reports)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="day-0 difference counted as a tie (default 0.01 of accuracy, 0.02 relative otherwise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="where advise.json and advise.png go (default: <run>/advise, "
                                               "./advise for hf:)")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--config.")]
    try:
        from favor import strings
        if bad:
            raise ValueError(f"unknown arguments {' '.join(bad)}: only --config.<key>=<value> flags may follow")
        for flag, value in (("--draws", args.draws), ("--batches", args.batches), ("--rounds", args.rounds)):
            if value < 1:
                raise ValueError(f"{flag} {value}: must be ≥ 1")
        if args.tolerance is not None and not args.tolerance >= 0:
            raise ValueError(f"--tolerance {args.tolerance}: must be ≥ 0 (a fraction: 0.01 is 1 point of accuracy)")
        if args.length is not None and args.length < 1:
            raise ValueError(f"--length {args.length}: must be ≥ 1")
        widths = strings.positive_ints("--num_features", args.num_features, nonempty=False) or None
        bands = None
        if args.bands:
            bands = [int(b) for b in strings.items(args.bands) if b.isdigit()]
            if len(bands) != len(strings.items(args.bands)):
                raise ValueError(f"--bands {args.bands!r}: expected whole numbers ≥ 0, e.g. 0,16")
        result = advise(args.workdir, args.config, rest, args.kinds, widths, bands, args.length, args.draws,
                        args.batches, args.rounds, args.seed, args.metric, args.tolerance,
                        log=lambda s: print(s, file=sys.stderr))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = result["summary"]
    out = Path(args.out or (Path(args.workdir) / "advise" if not args.workdir.startswith("hf:") else "advise"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.workdir}: {result['layers']} layers × {result['heads']} heads, {result['batches']} eval batches, "
          f"cost at L = {result['length']} ({'causal' if result['causal'] else 'bidirectional'}), "
          f"{result['draws']} draws")
    print(table(summary))
    if summary["recommendation"]:
        print(f"\nrecommended: {summary['reason']}")
    if summary.get("note"):
        print(f"note: {summary['note']}")
    layer_errors = {label: s.get("relative_error") for label, s in result["settings"].items()}
    plot(summary, layer_errors, out / "advise.png", f"{args.workdir}: which attention kind "
         f"({summary['metric']}, L = {result['length']})")
    (out / "advise.json").write_text(json.dumps(result, indent=1, default=float))
    print(f"figures: {out / 'advise.json'}, plot: {out / 'advise.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
