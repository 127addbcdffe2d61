"""Linearizing a softmax decoder, LoLCATs' way and by full fine-tuning: each linear kind with and without a
band of exact softmax, perplexity and the share of the gap to the source closed."""

from __future__ import annotations

import json
import math

import numpy as np

from favor import attention
from favor.config import loading
from favor.repro import trained
from favor.repro.report import Report

NAME = "linearize"
SUMMARY = ("A softmax decoder on the docstrings linearized as FAVOR+, FAVOR++, FAVOR#, Hedgehog, T2R and ELU, "
           "each with and without a band, by LoLCATs' recipe (transfer, then LoRA) and by full fine-tuning")
PROTOCOL = """\
LoLCATs (Zhang et al. 2024) linearizes a softmax LLM in two cheap stages: attention transfer, training only
the new attention's own parameters (Hedgehog's feature maps and a learned sliding-window mix) to
reproduce each softmax layer's output, then LoRA (rank 8 on q, k, v, o) on the language-model loss; the
window + linear layer is what makes it nearly lossless. Hedgehog (Zhang et al. 2024) reports learned
maps recovering softmax's quality where fixed feature maps do not. favor measures both, beside its own
random-feature kinds. The source: configs/linearize.py:stage=source, a softmax decoder (2 layers × 128
wide, 4 heads of 32, a 2,000-piece vocabulary, 128-token rows of the standard library's docstrings,
batch 16) trained `--source-steps` steps (default 3,000), half of every batch's rows, its own and every
linearized run's, MQAR (4 key-value pairs over 256 ids in the same 128 tokens, favor.data.mqar mixed in
by data.mix_in): a skill that needs the whole context, where the docstrings alone are local. Each setting continues it
(`model.init_from=run:<source>`) as one kind — FAVOR+, FAVOR++, FAVOR# (64 features), Hedgehog (64),
T2R (64), ELU — without and with a band of the last `--band` keys (default 8) exact, or as the band
alone (sliding-window softmax), by two recipes at the same budget of `--transfer-steps` +
`--steps` steps (default 50 + 250, 4,800 rows of 128 tokens): LoLCATs' (transfer training the maps and
the band's learned mix, LoRA in the transfer stage for a kind with neither; then LoRA alone) and full
fine-tuning (every parameter, the language-model loss throughout). Bands of Hedgehog, T2R and ELU use
LoLCATs' learned mix (their products are not on softmax's scale); those of the random-feature kinds
favor's shared normaliser (their products estimate exp(qᵀk/√D)). Day 0 is each run's evaluation before
its first step; perplexity is on held-out docstrings alone; the gap closed is (day 0 − final) / (day 0 −
source) in perplexity; recall the share of queried values the final model predicts on held-out MQAR
sequences (the in-context recall linear attention is known to lose). `--seeds` runs a
setting (default 2; seeds 0, 1: LoRA's and the maps' initialisation, the feature draws, data order);
mean ± sd over seeds; claims rated at 2 standard errors of the difference of means (favor.repro.trained).

Where favor differs from LoLCATs: a model ~60,000 times smaller than Llama 3 8B and trained minutes, not
weeks, so that rank-8 adapters are ~2 % of its parameters rather than 0.2 %; 0.6M tokens instead of
40M (half of them MQAR's); 128-token rows with an 8-key band (LoLCATs: 2048 or more with 64); perplexity on held-out
docstrings in place of MMLU and the LM evaluation harness.
"""

NAMES = {"softmax": "softmax", "favor+": "FAVOR+", "favor++": "FAVOR++", "favor#": "FAVOR#",
         "hedgehog": "Hedgehog", "t2r": "T2R", "elu": "ELU", "relu": "ReLU", "favor": "trig", "hrf": "HRF",
         "simrf": "SimRF"}
RECIPE_NAMES = {"lolcats": "LoLCATs", "full": "full FT"}
METRIC = "perplexity"
MOST = 0.5                # "closes most of the gap": more than half, a priori
RANDOM = ("FAVOR+", "FAVOR++", "FAVOR#")
PROBE_EXAMPLES = 512      # held-out MQAR sequences the recall probe reads


def add_arguments(parser):
    parser.add_argument("--kinds", default=None, help="'/'-separated linear kinds (default "
                                                      "favor+/favor++/favor#/hedgehog/t2r/elu; --quick hedgehog)")
    parser.add_argument("--band", type=int, default=None, help="the band's width in keys, 0: no banded settings "
                                                               "(default 8; --quick 4)")
    parser.add_argument("--recipes", default=None, help="'/'-separated: lolcats, full (default both; --quick lolcats)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per setting (default 2)")
    parser.add_argument("--source-steps", type=int, default=None, help="the source's steps (default 3000)")
    parser.add_argument("--transfer-steps", type=int, default=None, help="LoLCATs' transfer steps (default 50)")
    parser.add_argument("--steps", type=int, default=None, help="steps after the transfer (default 250)")
    trained.add_sweep_arguments(parser)


def setting_label(settings: dict) -> str:
    """A run's setting from its dotted overrides: "Hedgehog + band 16", "band 16 alone", "FAVOR#"."""
    kind = settings["model.attention.kind"]
    band = int(settings.get("model.attention.window") or 0)
    if kind == "softmax":
        return f"band {band} alone" if band else "softmax"
    return NAMES.get(kind, kind) + (f" + band {band}" if band else "")


def recipe_of(settings: dict) -> str:
    return "lolcats" if settings.get("uptrain.finetune") == "lora" else "full"


def label_of(settings: dict) -> str:
    """A setting and its recipe, "Hedgehog + band 8 | LoLCATs", from a run's dotted settings."""
    return f"{setting_label(settings)} | {RECIPE_NAMES[recipe_of(settings)]}"


def _label(run):
    return label_of(run.settings)


def plan(args) -> dict:
    """The source's and the linearization sweep's config specs, checked before anything trains."""
    quick = args.quick
    seeds = args.seeds if args.seeds is not None else 2
    if seeds < 2:
        raise ValueError(f"--seeds {seeds}: a comparison at 2 standard errors needs at least 2 seeds a setting")
    numbers = {"--source-steps": args.source_steps, "--transfer-steps": args.transfer_steps, "--steps": args.steps}
    if quick and any(v is not None for v in numbers.values()):
        raise ValueError(f"{', '.join(f'{k} {v}' for k, v in numbers.items() if v is not None)} with --quick: the "
                         "quick run linearizes the tests' model a few steps")
    if args.parallel < 1 or any(v is not None and v < 1 for k, v in numbers.items() if k != "--transfer-steps") \
            or (args.transfer_steps is not None and args.transfer_steps < 0) or (args.band is not None and args.band < 0):
        raise ValueError("--parallel, --source-steps and --steps must be positive, --transfer-steps and --band ≥ 0")
    kinds = args.kinds or ("hedgehog" if quick else "favor+/favor++/favor#/hedgehog/t2r/elu")
    loading.values("--kinds", kinds, [k for k in attention.names() if k != "softmax"])
    recipes = args.recipes or ("lolcats" if quick else "lolcats/full")
    loading.values("--recipes", recipes, ("lolcats", "full"))
    band = args.band if args.band is not None else (4 if quick else 8)
    size = "runlocal," if quick else ""
    steps = dict(source_steps=30, transfer_steps=2, steps=6) if quick else dict(
        source_steps=args.source_steps or 3000, steps=args.steps or 250,
        transfer_steps=50 if args.transfer_steps is None else args.transfer_steps)
    path = trained.config_path("linearize.py")
    source = f"{path}:{size}stage=source,source_steps={steps['source_steps']}"
    # the quick run leaves out the band alone: the tests' time (its path is the banded kinds' with softmax)
    sweep = (f"{path}:{size}seeds={seeds},kinds={kinds},band={band},recipes={recipes},"
             f"transfer_steps={steps['transfer_steps']},steps={steps['steps']}" + (",alone=False" if quick else ""))
    from favor import sweeps                  # the sweep's own settings are the ones the report asks for
    asked = sorted({label_of(r.overrides) for r in sweeps.load(sweep)})
    return {"source": source, "sweep": sweep, "seeds": seeds, "asked": asked, **steps}


def run(args):
    p = plan(args)
    root = trained.sweep_workdir(args)
    source = trained.run_sweep(p["source"], root / "source", args.parallel)
    if len(source) != 1:
        raise trained.SweepError(f"{root / 'source'}: expected one source run, found {len(source)}")
    runs = trained.run_sweep(p["sweep"], root / "linearize", args.parallel,
                             [f"--config.model.init_from=run:{source[0].workdir.resolve()}"])
    recall = {r.name: probe_recall(r.workdir) for r in [source[0], *runs]}
    return _report(p, source[0], runs, recall)


def probe_recall(workdir) -> float | None:
    """The share of queried values the run's final model predicts on PROBE_EXAMPLES sequences of the eval
    split of the MQAR task its data mixes in (`data.mix_in`: favor.data.mqar, the stream training never
    reads): the in-context recall linear attention is known to lose. None for a run with no MQAR mixed in.
    Kept in <workdir>/recall.json with the checkpoint it read, so a rerun reads it back."""
    from pathlib import Path
    config = json.loads((Path(workdir) / "config.json").read_text()) if (Path(workdir) / "config.json").exists() \
        else None
    block = dict(((config or {}).get("data") or {}).get("mix_in") or {})
    if block.get("name") != "mqar":
        return None
    steps = [int(d.name) for d in (Path(workdir) / "checkpoints").glob("*") if d.name.isdigit()]
    probe = {**block, "examples": PROBE_EXAMPLES, "step": max(steps, default=None)}    # a longer run probes again
    cache = Path(workdir) / "recall.json"
    if cache.exists():
        got = json.loads(cache.read_text())
        if got.get("probe") == probe:
            return float(got["recall"])
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from favor import data
    from favor.tools import generate
    _, model, _ = generate.load(workdir)
    source = data.get({**block, "num_eval": PROBE_EXAMPLES})
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)["logits"])
    hits = total = 0.0
    for batch in source.eval_batches(64):
        pred = np.asarray(jnp.argmax(logits(state, jnp.asarray(batch["input_ids"], jnp.int32)), -1))
        weights = batch["weights"] * batch["valid"][:, None]
        hits += float(np.sum((pred == batch["targets"]) * weights))
        total += float(weights.sum())
    recall = hits / total
    cache.write_text(json.dumps({"probe": probe, "recall": recall}))
    return recall


def _day0(run) -> float:
    points = dict(trained.curve(run, METRIC))
    if 0 not in points:
        raise trained.SweepError(f"run {run.name} has no step-0 {METRIC}: was it started from the source?")
    return points[0]


def _tokens(run) -> int | None:
    c = run.config or {}
    try:
        return int(c["total_steps"]) * int(c["batch_size"]) * int(c["data.max_length"])
    except (KeyError, TypeError, ValueError):
        return None


def _stats(settings: dict, source: float) -> dict:
    """{label: {"day0", "final", "closed": Stat}}: perplexities and the share of the gap closed, per seed."""
    out = {}
    for label, entry in settings.items():
        day0 = [_day0(r) for r in entry["runs"]]
        final = list(entry["stat"].values)
        closed = [(d - f) / (d - source) if d != source else math.nan for d, f in zip(day0, final)]
        out[label] = {"day0": trained.Stat(tuple(day0)), "final": entry["stat"], "closed": trained.Stat(tuple(closed))}
    return out


def _fraction(entry) -> float | None:
    values = [(r.summary or {}).get("trainable_fraction") for r in entry["runs"]]
    return None if any(v is None for v in values) else float(np.mean(values))


def _report(p: dict, source_run, runs, recall: dict) -> Report:
    settings = trained.by_setting(runs, _label, METRIC)
    source = trained.final_metric(source_run, METRIC)
    stats = _stats(settings, source)
    probed = recall.get(source_run.name) is not None
    for label, entry in settings.items():
        if probed:
            stats[label]["recall"] = trained.Stat(tuple(100 * recall[r.name] for r in entry["runs"]))
    src = trained.Stat((source, source))           # one run: its value, no spread
    rows = []
    for label in sorted(stats, key=lambda k: stats[k]["final"].mean):
        entry, s = settings[label], stats[label]
        name, _, recipe = label.partition(" | ")
        fraction = _fraction(entry)
        trainable = (entry["runs"][0].summary or {}).get("trainable_params")
        rows.append([name, recipe, s["day0"].text(1.0), s["final"].text(1.0), s["closed"].text(),
                     s["recall"].text(1.0) if probed else None,
                     None if trainable is None else f"{trainable:,} ({100 * fraction:.2f} %)",
                     _tokens(entry["runs"][0]), s["final"].n])
    comparisons = []
    lower = dict(higher_is_better=False)
    src_recall = trained.Stat((100 * recall[source_run.name],) * 2) if probed else None

    def rate(better, worse, key, why, scale=1.0):
        a, b = stats[better][key], stats[worse][key]
        v, z = trained.rate(a, b, **lower)
        comparisons.append((f"{better} ({a.text(scale)}) < {worse} ({b.text(scale)}){why} (z = {z:.1f})", v))

    for recipe in RECIPE_NAMES.values():
        for label in [k for k in stats if k.endswith(f"| {recipe}") and " alone" in k]:
            v, z = trained.rate(src, stats[label]["final"], **lower)
            comparisons.append((f"task check: the softmax source ({source:.1f}) below the {label.split(' |')[0]} "
                                f"model after the same budget ({stats[label]['final'].text(1.0)}), perplexity: the "
                                f"task needs more than the band (z = {z:.1f})", v))
            if probed:
                got = stats[label]["recall"]
                v, z = trained.rate(src_recall, got)
                comparisons.append((f"task check: the softmax source recalls {src_recall.mean:.1f} % of MQAR's "
                                    f"queried values, above the {label.split(' |')[0]} model ({got.text(1.0)} %): "
                                    f"recall needs more than the band (z = {z:.1f})", v))
        if probed:
            # linear kinds without a band: neither "X + band w" nor the band alone ("band w alone")
            alone = [k for k in stats if k.endswith(f"| {recipe}") and "band" not in k.split(" |")[0]]
            if alone:
                best = max(alone, key=lambda k: stats[k]["recall"].mean)
                got = stats[best]["recall"]
                v, z = trained.rate(src_recall, got)
                comparisons.append((f"Zoology: a linear attention's fixed state recalls less than softmax's cache — "
                                    f"the source {src_recall.mean:.1f} % against the best linear kind without a "
                                    f"band, {best} ({got.text(1.0)} %) (z = {z:.1f})", v))
    lol = RECIPE_NAMES["lolcats"]
    for label in [k for k in stats if k.endswith(f"| {lol}") and " + band " in k]:
        v, z = trained.rate(stats[label]["closed"], trained.Stat((MOST, MOST)))
        comparisons.append((f"LoLCATs: transfer + LoRA closes most of the gap — {label.split(' |')[0]} closes "
                            f"{stats[label]['closed'].text()} % of it (> {100 * MOST:.0f} %; "
                            f"{100 * (_fraction(settings[label]) or 0):.2f} % of the parameters trained) (z = {z:.1f})", v))
        plain = label.replace(" + band ", " | ").split(" | ")[0] + f" | {lol}"
        if plain in stats:
            rate(label, plain, "final", " — LoLCATs: band + linear beats linear alone, perplexity")
    for kind in RANDOM:
        if f"Hedgehog | {lol}" in stats and f"{kind} | {lol}" in stats:
            rate(f"Hedgehog | {lol}", f"{kind} | {lol}", "final",
                 " — Hedgehog: learned maps beat fixed random features after transfer, perplexity")
    for other in ("FAVOR+", "FAVOR++"):
        # day 0 is before any step, so the recipes' runs measure the same thing: rated on the first with both
        recipe = next((r for r in RECIPE_NAMES.values() if f"FAVOR# | {r}" in stats and f"{other} | {r}" in stats),
                      None)
        if recipe:
            rate(f"FAVOR# | {recipe}", f"{other} | {recipe}", "day0",
                 " — favor: FAVOR# inherits the most on day 0, perplexity before any step")
    full = RECIPE_NAMES["full"]
    notes = [f"The source: `{trained.checkout_spec(p['source'])}` ({source_run.summary.get('step')} "
             f"steps, validation perplexity {source:.1f}); the sweep `{trained.checkout_spec(p['sweep'])}` from `--config.model.init_from=run:<source>`" + trained.timing(runs) + "."]
    pairs = [(k, k.replace(f"| {lol}", f"| {full}")) for k in stats if k.endswith(f"| {lol}")]
    pairs = [(a, b) for a, b in pairs if b in stats]
    if pairs:
        text = "; ".join(f"{a.split(' |')[0]} {stats[a]['final'].text(1.0)} against {stats[b]['final'].text(1.0)}"
                         for a, b in pairs)
        notes.append(f"LoLCATs' recipe against full fine-tuning at the same budget (perplexity): {text}.")
    mse = {}
    for label, entry in settings.items():
        got = [(r.summary or {}).get("attention_mse") for r in entry["runs"]]
        if all(got):
            first, last = (np.mean([np.mean(g[k]) for g in got]) for k in (min(got[0], key=int), max(got[0], key=int)))
            mse[label] = (float(first), float(last))
    if mse:
        notes.append("Attention MSE against softmax before → after the transfer stage (mean over layers and seeds): "
                     + "; ".join(f"{k.split(' |')[0]} {a:.3g} → {b:.3g}" for k, (a, b) in mse.items()) + ".")
    block = {k.rsplit(".", 1)[1]: v for k, v in (source_run.config or {}).items() if k.startswith("data.mix_in.")}
    if probed:
        notes.append(f"Recall: the share of queried values each final model predicts on {PROBE_EXAMPLES} held-out "
                     f"MQAR sequences (favor.data.mqar, {block.get('num_pairs')} key-value pairs at the row length "
                     f"over the vocabulary's first {block.get('vocab_size')} ids), the task the source's and every "
                     f"run's training batches mix in at {source_run.config.get('data.mix_rate')} of each batch; the "
                     f"softmax source recalls {src_recall.mean:.1f} %.")
    checks = [trained.complete(settings, p["asked"], runs, p["seeds"], METRIC)]
    figures = {"source": {"config": trained.checkout_spec(p["source"]), "perplexity": source,
                          "steps": source_run.summary.get("step"), "recall": recall[source_run.name]},
               "probe": {**block, "examples": PROBE_EXAMPLES} if probed else None,
               "sweep": trained.checkout_spec(p["sweep"]), "seeds": p["seeds"], "attention_mse": mse,
               "settings": {k: {"day0": list(s["day0"].values), "final": list(s["final"].values),
                                "closed": list(s["closed"].values),
                                "recall": list(s["recall"].values) if probed else None,
                                "tokens": _tokens(settings[k]["runs"][0]),
                                "trainable_fraction": _fraction(settings[k]),
                                "runs": [r.name for r in settings[k]["runs"]],
                                "curves": {r.name: trained.curve(r, METRIC) for r in settings[k]["runs"]}}
                            for k, s in stats.items()}}

    def plot(fig):
        _plot(fig, settings, stats, source, src_recall.mean if probed else None)

    return Report(title=f"{NAME}: a softmax decoder linearized by LoLCATs' recipe and by full fine-tuning",
                  protocol=PROTOCOL, columns=["setting", "recipe", "day 0 perplexity", "perplexity",
                                              "gap closed (%)", "recall (%)", "trained parameters", "tokens",
                                              "seeds"],
                  rows=rows, figures=figures, plot=plot, checks=checks, comparisons=comparisons, notes=notes,
                  figsize=(19 if probed else 15, 6.5))


def _plot(fig, settings, stats, source, source_recall):
    import matplotlib
    if source_recall is None:
        ax_curve, ax_dots = fig.subplots(1, 2, width_ratios=[1, 1.2])
    else:
        ax_curve, ax_dots, ax_recall = fig.subplots(1, 3, width_ratios=[1, 1.2, 0.55])
    colours = matplotlib.colormaps["tab20"]            # 13 settings: one colour each, not cycled
    names = list(dict.fromkeys(k.split(" | ")[0] for k in stats))
    colour = {n: colours(i % 20) for i, n in enumerate(names)}
    for label, entry in settings.items():
        name, _, recipe = label.partition(" | ")
        steps, mean, _ = trained.mean_curve(entry["runs"], METRIC)
        ax_curve.plot(steps, mean, marker="o", ms=3, color=colour[name], ls="-" if recipe == "LoLCATs" else "--",
                      label=label)
    ax_curve.axhline(source, color="black", lw=1.5, label=f"softmax source ({source:.1f})")
    ax_curve.set_yscale("log")
    ax_curve.set_xlabel("step after the source (0: day 0; LoLCATs' transfer stage first)")
    ax_curve.set_ylabel("validation perplexity (log scale), mean over seeds")
    ax_curve.set_title("perplexity during linearization (solid: LoLCATs, dashed: full FT)")
    ax_curve.grid(alpha=0.3, which="both")
    ax_curve.legend(fontsize=6.5, loc="upper right", ncol=2)
    order = sorted(stats, key=lambda k: -stats[k]["final"].mean)
    ys = np.arange(len(order))
    for y, label in zip(ys, order):
        name = label.split(" | ")[0]
        for key, face in (("day0", "white"), ("final", colour[name])):
            s = stats[label][key]
            se = s.sd / math.sqrt(s.n) if s.n > 1 else 0.0
            ax_dots.errorbar(s.mean, y, xerr=2 * se, fmt="o", mfc=face, mec=colour[name], color=colour[name], ms=7,
                             capsize=3)
        ax_dots.annotate(f"{100 * stats[label]['closed'].mean:.0f} % closed", (stats[label]["final"].mean, y),
                         textcoords="offset points", xytext=(0, 6), fontsize=6.5, ha="center")
    ax_dots.axvline(source, color="black", lw=1.5, label="softmax source")
    ax_dots.set_xscale("log")
    ax_dots.set_yticks(ys, order, fontsize=7)
    ax_dots.set_xlabel("validation perplexity (log scale): ○ day 0, ● after the budget; mean ± 2 SE")
    ax_dots.set_title("each setting: day 0 and after, with the share of the gap to the source closed")
    ax_dots.grid(alpha=0.3, axis="x", which="both")
    ax_dots.legend(fontsize=7, loc="lower right")
    if source_recall is not None:
        for y, label in zip(ys, order):
            s = stats[label]["recall"]
            se = s.sd / math.sqrt(s.n) if s.n > 1 else 0.0
            name = label.split(" | ")[0]
            ax_recall.errorbar(s.mean, y, xerr=2 * se, fmt="o", color=colour[name], ms=7, capsize=3)
        ax_recall.axvline(source_recall, color="black", lw=1.5, label=f"softmax source ({source_recall:.0f} %)")
        ax_recall.set_yticks(ys, [""] * len(ys))
        ax_recall.set_ylim(ax_dots.get_ylim())
        ax_recall.set_xlim(-3, 103)
        ax_recall.set_xlabel("MQAR recall (%) after the budget, mean ± 2 SE")
        ax_recall.set_title("associative recall (held-out MQAR)")
        ax_recall.grid(alpha=0.3, axis="x")
        ax_recall.legend(fontsize=7, loc="lower right")
    fig.suptitle("Linearizing a softmax decoder: perplexity of each linear attention, LoLCATs' recipe against "
                 "full fine-tuning")
