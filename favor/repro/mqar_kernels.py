"""Multi-query associative recall against state size (Zoology's figure): every attention kind's decoder
at several feature widths, the window hybrid and softmax, on favor's MQAR."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from favor import attention, strings
from favor.config import loading
from favor.repro import trained
from favor.repro.report import Report

NAME = "mqar-kernels"
SUMMARY = ("MQAR recall against state size: FAVOR+ and FAVOR# at 3 widths, the other kinds at one, a softmax band, "
           "softmax; 3 seeds")
PROTOCOL = """\
Zoology (Arora, Eyuboglu et al. 2023, Fig. 2 and §3): multi-query associative recall, where a model reads
key-value pairs and must return the value of each key asked later; attention solves it at every
size, and a recurrent model recalls as much as its fixed state holds, so accuracy rises with state
size. favor's MQAR (favor.data.mqar, Zoology's construction: `--pairs` pairs, default 4, queries at
power-law distances, random filler tokens) at 64 tokens over a 256-token vocabulary; the model is
configs/mqar.py's 2-layer, 64-wide, 2-head decoder (Zoology's smallest width), AdamW at 3e-3 with a
cosine schedule, `--steps` steps (default 1,500) of `--batch` sequences (default 32); recall is the
share of queried values predicted exactly on 1,000 held-out sequences. A model that answers with a
value of the context but not the asked key's scores 1 / pairs (25 % at 4 pairs): recall above that
is association. Settings: softmax; each random-feature kind at every feature width F of `--widths`
(a decoding state of 2 layers × 2 heads × F × (head dim + 2) numbers: the feature sums and the
per-feature stabiliser); each kind of `--others` (default trig, FAVOR++, HRF, SimRF and ReLU) at the
middle width only, trig and HRF with queries and keys on the sphere (qk_norm=l2, as favor advises
for sign-indefinite kinds); ELU and ReLU (deterministic feature maps as wide as a head); FAVOR+ at the middle
width plus exact softmax over the last `--bands` tokens (favor's window hybrid: the band's keys,
values, log-features and positions join the state). State sizes are measured: the numbers in each
model's decoding cache for one sequence (favor's `prefill`), softmax's being its key/value cache of
the whole sequence. Each setting is trained `--seeds` times (seeds 0, 1, 2: initialisation, data order
and feature draws); mean ± sd over seeds; claims rated at 2 standard errors of the difference of means.

Where favor differs from Zoology: a 256-token vocabulary (Zoology's 8192 needs more steps than a CPU
gives: softmax stays at chance after 600 steps), 48,000 training sequences instead of 64 epochs of
100,000, one learning rate rather than the best of a sweep, one sequence length, and only FAVOR+ and
FAVOR# at three widths (the other kinds at the middle one) so that the runs fit about 2 hours on 2 CPU
cores.
"""

LABELS = {"softmax": "softmax", "favor": "trig", "favor+": "FAVOR+", "favor++": "FAVOR++", "favor#": "FAVOR#",
          "hrf": "HRF", "simrf": "SimRF", "relu": "ReLU", "elu": "ELU"}
SOLVED = 0.9          # recall at which a setting counts as solving the task (a priori, not fitted)


def add_arguments(parser):
    parser.add_argument("--pairs", type=int, default=None, help="key-value pairs a sequence (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 1500)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 32)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per setting (default 3; --quick 2)")
    parser.add_argument("--widths", default=None, help="'/'-separated feature widths (default 16/64/256)")
    parser.add_argument("--kinds", default=None, help="'/'-separated random-feature kinds, relu and elu "
                                                      "(default favor+/favor#/elu; --quick favor+)")
    parser.add_argument("--others", default=None, help="'/'-separated kinds trained at the middle width only "
                                                       "(default favor/favor++/hrf/simrf/relu; --quick none)")
    parser.add_argument("--bands", default=None, help="'/'-separated softmax bands for FAVOR+ at the middle "
                                                      "width, '' for none (default 8; --quick none)")
    trained.add_sweep_arguments(parser)


def _label(run):
    s = run.settings
    kind = s["model.attention.kind"]
    name = LABELS.get(kind, kind)
    if kind in ("softmax", "relu", "elu"):
        return name
    band = int(s.get("model.attention.window") or 0)
    if s.get("model.attention.qk_norm"):
        name += f" (qk {s['model.attention.qk_norm']})"
    return f"{name} F={int(s['model.attention.num_features'])}" + (f" + band {band}" if band else "")


def state_numbers(config) -> int:
    """The numbers one sequence's decoding state holds for `config`'s model (its `prefill` cache at the
    full sequence length, shapes only)."""
    from favor import job                # builds the model as a run does
    model = job.model_builder(config)[0]()
    length = int(config.data.seq_len)
    caches = jax.eval_shape(lambda: model.prefill(jnp.ones((1, length), jnp.int32), length)[-1])
    return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(caches)))


def run(args):
    quick = args.quick
    seeds = args.seeds if args.seeds is not None else (2 if quick else 3)
    if seeds < 2:
        raise ValueError(f"--seeds {seeds}: a comparison at 2 standard errors needs at least 2 seeds a setting")
    if quick and any(v is not None for v in (args.steps, args.pairs, args.batch)):
        raise ValueError("--steps, --pairs and --batch with --quick: the quick run trains the tests' model 30 steps")
    widths = args.widths or ("16" if quick else "16/64/256")
    kinds = args.kinds or ("favor+" if quick else "favor+/favor#/elu")
    others = args.others if args.others is not None else ("" if quick else "favor/favor++/hrf/simrf/relu")
    bands = args.bands if args.bands is not None else ("" if quick else "8")
    width_list = strings.positive_ints("--widths", widths)
    band_list = strings.positive_ints("--bands", bands, nonempty=False)
    if args.parallel < 1 or any(v is not None and v < 1 for v in (args.steps, args.pairs, args.batch)):
        raise ValueError("--parallel, --steps, --pairs and --batch must be positive")
    spec = [f"seeds={seeds}", f"widths={widths}", f"kinds={kinds}"] + ([f"others={others}"] if others else [])
    spec += [f"bands={bands}"]
    spec += ["runlocal"] if quick else [f"pairs={args.pairs or 4}", f"steps={args.steps or 1500}",
                                        f"batch={args.batch or 32}"]
    config = trained.config_path("mqar.py") + ":" + ",".join(spec)
    runs = trained.run_sweep(config, trained.sweep_workdir(args), args.parallel)
    settings = trained.by_setting(runs, _label, "accuracy")
    sizes = {}
    for label, entry in settings.items():
        c = loading.load(config)
        for key, value in entry["runs"][0].overrides.items():           # the sweep's settings of the run
            if key.startswith("model."):
                loading.apply_flag(c, f"{key}={value}")
        sizes[label] = state_numbers(c)
    asked = asked_settings(loading.values("kinds", kinds, tuple(LABELS)),
                           sorted(set(width_list)), band_list, loading.values("others", others, tuple(LABELS)))
    return _report(settings, sizes, runs, config, seeds, asked, pairs=int(loading.load(config).data.num_pairs))


def asked_settings(kinds, widths, bands, others=()):
    out = ["softmax"]
    for k in list(kinds) + [k for k in others if k not in kinds]:
        ws = widths if k in kinds else [widths[len(widths) // 2]]
        name = LABELS[k] + ("" if getattr(attention.get(k), "positive", True) else " (qk l2)")
        out += [name] if k in ("relu", "elu") else [f"{name} F={w}" for w in ws]
    out += [f"FAVOR+ F={widths[len(widths) // 2]} + band {b}" for b in bands if b > 0]
    return out


def _families(settings):
    """{kind label: [(width, setting label), ...] by width} of the random-feature settings without a band."""
    out: dict[str, list] = {}
    for label in settings:
        name, _, rest = label.partition(" F=")
        if rest and " + band" not in rest:
            out.setdefault(name, []).append((int(rest), label))
    return {k: sorted(v) for k, v in out.items()}


def _report(settings, sizes, runs, config, seeds, asked, pairs=None):
    ref = settings.get("softmax")
    rows = []
    for row in trained.setting_rows(settings, "softmax"):
        rows.append(row[:3] + [sizes.get(row[0])] + row[3:])
    comparisons = []
    families = _families(settings)
    if ref is not None:
        stat = ref["stat"]
        se = stat.sd / np.sqrt(stat.n) if stat.n > 1 else 0.0
        z = (stat.mean - SOLVED) / se if se > 0 else (np.inf if stat.mean >= SOLVED else -np.inf)
        v = "agrees" if z > 2 else "disagrees" if z < -2 else "within noise"
        comparisons.append((f"Zoology: attention solves MQAR — softmax recalls {stat.text()} % against the "
                            f"{100 * SOLVED:.0f} % taken as solved (z = {z:.1f})", v))
        rf = [k for k in settings if k != "softmax"]
        if rf:
            weakest = min(rf, key=lambda k: settings[k]["stat"].mean)
            v, z = trained.rate(stat, settings[weakest]["stat"])
            comparisons.append((f"task check: softmax above the weakest setting, {weakest} "
                                f"({settings[weakest]['stat'].text()} %), picked as the lowest mean of {len(rf)} "
                                f"(which favours agreement) (z = {z:.1f})", v))
    for name, members in families.items():
        if len(members) > 1:
            text, v = trained.claim(settings, members[-1][1], members[0][1], "")
            comparisons.append(("Zoology: more state recalls more — " + text, v))
        if ref is not None:
            wide = members[-1][1]
            v, z = trained.rate(ref["stat"], settings[wide]["stat"])
            comparisons.append((f"softmax above {wide}, the kind's widest state ({sizes.get(wide)} numbers "
                                f"against softmax's {sizes.get('softmax')}) (z = {z:.1f})", v))
    for better, source in (("FAVOR#", "data-dependent features recover part of the recall"),
                           ("FAVOR++", "CRT: FAVOR++ better than FAVOR+ in training")):
        for width, label in families.get(better, []):
            base = f"FAVOR+ F={width}"
            if base in settings:
                comparisons.append(trained.claim(settings, label, base, f" — {source}"))
    for label in settings:
        if " + band " in label:
            base = label.split(" + band ")[0]
            if base in settings:
                comparisons.append(trained.claim(settings, label, base, ": the window hybrid recovers part of "
                                                 "the recall", alone=True))
    checks = [trained.complete(settings, asked, runs, seeds, "accuracy")]
    spec = trained.checkout_spec(config)
    notes = [f"The sweep: `{spec}` (launch/sweep_local.py, resumable)" + trained.timing(runs) + "."]
    if pairs:
        # a model that answers with some value of the context, not the asked key's, scores 1 / pairs
        floor = trained.Stat((1.0 / pairs,) * 2)
        above = [k for k in settings if trained.rate(settings[k]["stat"], floor)[0] == "agrees"]
        notes.append(f"Answering with a value seen in the context but not the asked key's scores 1 / {pairs} = "
                     f"{100 / pairs:.0f} %; above it at 2 SE (association): {', '.join(above) or 'none'}.")
    figures = {"config": spec, "seeds": seeds, "pairs": pairs, "state_numbers": sizes,
               "settings": trained.settings_figures(settings, "accuracy")}

    def plot(fig):
        ax_state, ax_curve = fig.subplots(1, 2, width_ratios=[1.2, 1])
        import matplotlib
        colours = matplotlib.colormaps["tab10"]
        colour = {}
        for i, (name, members) in enumerate(families.items()):
            colour[name] = colours(i % 10)
            xs = [sizes[label] for _, label in members]
            ys = [100 * settings[label]["stat"].mean for _, label in members]
            sd = [100 * settings[label]["stat"].sd for _, label in members]
            ax_state.errorbar(xs, ys, yerr=sd, marker="o", capsize=3, color=colour[name], label=name)
            for (width, label), x, y in zip(members if len(members) > 1 else [], xs, ys):   # one width: legend
                ax_state.annotate(f"F={width}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                                  color=colour[name])
        singles = [k for k in settings if k.split(" F=")[0] not in families or " + band " in k]
        markers = {"softmax": "*"}
        shapes = "sD^v<>"                       # ELU and ReLU share a state size: distinct marks
        for j, label in enumerate(singles):
            stat = settings[label]["stat"]
            colour[label] = "black" if label == "softmax" else colours((len(families) + j) % 10)
            ax_state.errorbar([sizes[label]], [100 * stat.mean], yerr=[100 * stat.sd], capsize=3, ls="none",
                              marker=markers.get(label, shapes[j % len(shapes)]), ms=12 if label == "softmax" else 7,
                              color=colour[label], label=label)
        if pairs:
            ax_state.axhline(100 / pairs, color="grey", ls=":", lw=1,
                             label=f"a context value, not the key's ({100 / pairs:.0f} %)")
        ax_state.set_xscale("log")
        ax_state.set_xlabel("decoding state of one sequence (numbers, log scale)")
        ax_state.set_ylabel("recall accuracy (%), mean over seeds ± sd")
        ax_state.set_ylim(0, 105)
        ax_state.grid(alpha=0.3)
        ax_state.legend(fontsize=8, loc="upper left")
        ax_state.set_title("recall against state size")
        narrower = {label for members in families.values() for _, label in members[:-1]}
        for label, entry in settings.items():
            steps, mean, _ = trained.mean_curve(entry["runs"], "accuracy")
            c = colour.get(label, colour.get(label.split(" F=")[0]))
            ax_curve.plot(steps, 100 * mean, marker="o", ms=3, color=c, label=label,
                          ls=":" if label in narrower else "-")
        ax_curve.set_xlabel("training step")
        ax_curve.set_ylabel("eval recall (%), mean over seeds")
        ax_curve.set_ylim(0, 105)
        ax_curve.grid(alpha=0.3)
        ax_curve.legend(fontsize=7, loc="upper left", ncol=2)
        ax_curve.set_title("recall during training (dotted: narrower widths)")
        fig.suptitle(f"MQAR: recall per attention setting against the state it decodes with ({seeds} seeds each)")

    return Report(title=f"{NAME}: associative recall against state size, every kind against softmax",
                  protocol=PROTOCOL, columns=["setting", "accuracy (%)", "Δ vs softmax (± SE)", "state (numbers)",
                                              "steps/s", "parameters", "seeds"],
                  rows=rows, figures=figures, plot=plot, checks=checks, comparisons=comparisons, notes=notes,
                  figsize=(15, 6.0))
