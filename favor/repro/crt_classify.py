"""CRT Table 1 / §9.10.2: non-parametric classification with the Gaussian kernel approximated by each
random-feature mechanism."""

from __future__ import annotations

import numpy as np

from favor import kernels, strings
from favor.repro import classify
from favor.repro.report import Report

NAME = "crt-classify"
SUMMARY = "CRT Table 1: kernel-regression classification accuracy per mechanism (M = 128)"
PROTOCOL = """\
CRT §5.2 / §9.10.2. Predicted label distribution r* = Σ_i K(σo*, σo_i) r_i / Σ_i K(σo*, σo_i), the
Gaussian kernel estimated by each mechanism. Each data set is split at random 90 / 5 / 5 (train /
validation / test, fixed by the seed, the same for every method); σ is chosen among 10 log-uniform
values in [1e-2, 1e2] by the mean validation accuracy over 50 feature seeds, and the test accuracy
at that σ is averaged over 50 fresh seeds (mean ± sd over seeds). M = 128 real features (trig: 64
frequencies; HRF: the m whose feature width is closest below 128); orthogonal ω for the GERF
descendants (PosRF, OPRF, and the FAVOR# family), iid for trig, HRF and the integer draws of
Poisson/geometric RFs. PoisRF+ and GeomRF+ take their shift c = min − ε from the training split
with the paper's ε = 1e-8 (favor's option shift_eps; the library's default is 1e-2, see --shift_eps)
and clamp validation and test inputs at c + ε. The exact kernel's accuracy is the ceiling.

Where favor differs: the paper's eight UCI sets cannot be downloaded here; the default data are the
four sets that ship with scikit-learn (`--data` takes any other: an .npz with x and y, a CSV whose
last column is the label, or sklearn:<name>). Features are z-scored with the training split's
statistics. Every mechanism is fitted on the training split alone (the paper does not say; this
leaks no test data). GERF with complex A (s = −1) is not a favor mechanism; favor's real GERF at its
optimum is OPRF (the paper's GERF column takes the better of s = ±1). The paper's rows (Table 1, its
eight UCI sets and its Average row) are printed for reference in the columns of the mechanisms run.
"""

PAPER_MECHS = ("trig", "positive", "gerf", "poisson", "geometric", "oprf", "poisson+", "geometric+")
EXTRA_MECHS = ("saderf", "aderf", "sderf", "hrf-angular")
LABELS = {"trig": "TrigRF", "positive": "PosRF", "poisson": "PoisRF", "geometric": "GeomRF",
          "oprf": "OPRF", "poisson+": "PoisRF+", "geometric+": "GeomRF+", "saderf": "SADERF",
          "aderf": "ADERF", "sderf": "SDERF", "hrf-angular": "HRF-angular", "hrf-gaussian": "HRF-Gaussian",
          "gerf": "GERF (real)", "hrf-cluster": "HRF-cluster", "exact": "exact kernel"}
ORTHOGONAL = ("positive", "gerf", "oprf", "saderf", "aderf", "sderf")
SHIFTED = ("poisson+", "geometric+")
PAPER_EPS = 1e-8   # CRT §9.10.2: the ε of the shift c = min − ε of PoisRF+ and GeomRF+
# CRT Table 1 (test accuracy %, M = 128) for reference: its data sets are UCI's, not these. Columns in
# the paper's order TrigRF, PosRF, GERF, PoisRF, GeomRF, OPRF, PoisRF+, GeomRF+.
_PAPER_ROWS = {
    "abalone": (12.0, 16.0, 17.0, 18.0, 18.3, 17.1, 14.0, 15.1),
    "banknote": (66.2, 83.4, 92.4, 84.4, 94.5, 92.6, 80.1, 85.6),
    "car": (66.3, 69.2, 70.9, 66.3, 66.3, 69.5, 66.3, 67.2),
    "yeast": (29.7, 34.4, 42.9, 36.9, 35.9, 44.4, 29.7, 31.0),
    "cmc": (46.6, 45.1, 47.8, 46.6, 47.3, 46.3, 35.5, 43.5),
    "nursery": (31.3, 77.4, 63.8, 77.1, 77.1, 78.9, 77.3, 71.0),
    "wifi": (15.2, 88.8, 93.3, 95.3, 95.8, 93.3, 77.2, 82.9),
    "chess": (16.5, 20.2, 20.4, 19.1, 19.5, 20.2, 19.2, 22.5),
    "Average": (35.5, 54.3, 56.1, 55.5, 56.8, 57.8, 49.9, 52.3),   # the paper's own Average row
}
PAPER_TABLE = {name: dict(zip(PAPER_MECHS, accs)) for name, accs in _PAPER_ROWS.items()}
PAPER_AVERAGE = PAPER_TABLE["Average"]


def add_arguments(parser):
    parser.add_argument("--data", action="append", default=None,
                        help="a data set: sklearn:<iris|wine|breast_cancer|digits>, x/y .npz or CSV "
                             "(repeatable; default the four scikit-learn sets; --quick sklearn:iris)")
    parser.add_argument("--mechanisms", default=None,
                        help="comma-separated mechanism names (default: the paper's eight and "
                             f"{', '.join(EXTRA_MECHS)}; --quick trig, positive, oprf, poisson+); any of: "
                             f"{', '.join(kernels.names())}")
    parser.add_argument("--seeds", type=int, default=None, help="feature seeds (default 50; --quick 5)")
    parser.add_argument("--budget", type=int, default=128,
                        help="real numbers per feature vector, M (default %(default)s)")
    parser.add_argument("--sigmas", type=int, default=None,
                        help="values on the log-uniform σ grid in [1e-2, 1e2] (default 10; --quick 4)")
    parser.add_argument("--shift_eps", type=float, default=PAPER_EPS,
                        help="ε of PoisRF+/GeomRF+'s shift c = min − ε and of the query clamp "
                             "(default %(default)g, the paper's; favor's library default is 1e-2)")


def methods_for(names, budget, shift_eps=PAPER_EPS):
    out = []
    for name in names:
        coupling = "orthogonal" if name in ORTHOGONAL else "iid"
        options = (("shift_eps", float(shift_eps)),) if name in SHIFTED else ()
        out.append(classify.Method(LABELS.get(name, name), name,
                                   classify.budget_features(name, budget, options), coupling, options))
    return out


def mechanism_list(arg, quick):
    if arg is None:
        return ("trig", "positive", "oprf", "poisson+") if quick else PAPER_MECHS + EXTRA_MECHS
    names = strings.choices("--mechanisms", arg, kernels.names(), nonempty=True)
    return names


def run(args):
    quick = args.quick
    names = mechanism_list(args.mechanisms, quick)
    specs = args.data or (["sklearn:iris"] if quick else [f"sklearn:{n}" for n in classify.SKLEARN_SETS])
    seeds = args.seeds or (5 if quick else 50)
    n_sigmas = args.sigmas or (4 if quick else 10)
    if seeds < 1 or n_sigmas < 1 or args.budget < 1:
        raise ValueError("--seeds, --sigmas and --budget must be positive")
    if not args.shift_eps > 0:
        raise ValueError(f"--shift_eps must be positive; got {args.shift_eps}")
    sigmas = np.logspace(-2, 2, n_sigmas)
    methods = methods_for(names, args.budget, args.shift_eps) + [classify.Method("exact kernel", None)]
    results = {}
    for spec in specs:
        x, y, dname = classify.load(spec)
        data = classify.split(x, y, dname, args.seed)
        results[dname] = {"n": len(x), "d": x.shape[1], "classes": data.classes,
                          "sizes": [len(data.train[0]), len(data.val[0]), len(data.test[0])]}
        for k, method in enumerate(methods):
            mean, sd, sigma, val = classify.evaluate(method, data, sigmas, seeds, args.seed + 100 * k)
            results[dname][method.label] = {"mean": mean, "sd": sd, "sigma": sigma, "val": val,
                                            "num_features": method.num_features,
                                            "coupling": method.coupling}
    labels = [m.label for m in methods]
    rows = []
    for dname, res in results.items():
        rows.append([dname] + [f"{100 * res[lab]['mean']:.1f} ± {100 * res[lab]['sd']:.1f}" for lab in labels]
                    + [res["sizes"][0]])
    for dname, accs in PAPER_TABLE.items():
        where = "its own average over its eight UCI sets" if dname == "Average" else "UCI"
        rows.append([f"paper: {dname} ({where})"] + [f"{accs[n]:.1f}" if n in accs else None for n in names]
                    + [None, None])

    def avg(label):
        return float(np.mean([res[label]["mean"] for res in results.values()]))

    checks = []
    for dname, res in results.items():
        ceiling = res["exact kernel"]["mean"]
        ok = all(res[lab]["mean"] <= ceiling + 3 * res[lab]["sd"] / np.sqrt(seeds) + 1e-9
                 for lab in labels[:-1])
        checks.append((f"{dname}: no mechanism beats the exact kernel beyond 3 SE (ceiling "
                       f"{100 * ceiling:.1f} %)", ok))
    notes = _notes(names, methods, results, labels, avg, args.budget, seeds, args.shift_eps)

    def plot(fig):
        classify.plot_accuracies(
            fig.subplots(1, 1), results, labels,
            lambda d: f"{d}\n(N = {results[d]['n']}, d = {results[d]['d']})",
            f"CRT Table 1 protocol on scikit-learn sets: kernel regression with M = {args.budget} "
            f"random features, σ tuned on validation, {seeds} seeds")

    return Report(
        title="crt-classify: CRT Table 1 (non-parametric classification)",
        protocol=PROTOCOL, columns=["data set"] + labels + ["train size"], rows=rows, checks=checks,
        notes=notes, plot=plot, figsize=(15, 5.5),
        figures={"sigmas": sigmas, "seeds": seeds, "budget": args.budget, "shift_eps": args.shift_eps,
                 "results": results, "paper": PAPER_TABLE})


def _notes(names, methods, results, labels, avg, budget, seeds, shift_eps):
    """The notes under the table, from this run's mechanisms and figures."""
    mlabels = labels[:-1]
    order = sorted(mlabels, key=avg, reverse=True)
    sets = ", ".join(results)
    notes = ["Ranking by mean accuracy over " + sets + ": "
             + " > ".join(f"{lab} {100 * avg(lab):.1f}" for lab in order)
             + f" (exact kernel {100 * avg('exact kernel'):.1f}) %."]
    in_paper = [n for n in names if n in PAPER_AVERAGE]
    if in_paper:
        paper_order = sorted(in_paper, key=lambda n: PAPER_AVERAGE[n], reverse=True)
        here_order = sorted(in_paper, key=lambda n: avg(LABELS.get(n, n)), reverse=True)
        text = ("The paper's ranking of these mechanisms by its own Average row (eight UCI sets, Table 1): "
                + " > ".join(f"{LABELS[n].replace(' (real)', '')} {PAPER_AVERAGE[n]:.1f}" for n in paper_order)
                + " %. The same mechanisms here: " + " > ".join(LABELS.get(n, n) for n in here_order) + ".")
        if len(in_paper) > 1:
            text += (" The orderings agree." if paper_order == here_order else
                     " The orderings differ; the paper's is about its UCI sets and is reported, not checked.")
        if "trig" in in_paper:
            rank = here_order.index("trig") + 1
            text += (f" TrigRF is last in the paper ({PAPER_AVERAGE['trig']:.1f} %), a place two of its sets "
                     f"decide (nursery and wifi: 31.3 and 15.2 % against 63.8–95.8 % for the others); here "
                     f"it ranks {rank} of {len(in_paper)}.")
        if "gerf" in in_paper:
            text += (" The paper's GERF column is the better of its complex (s = −1) and real (s = +1) "
                     "optima; favor's GERF (real) at its default A is OPRF's A*, so its figures differ from "
                     "OPRF's by seed noise only.")
        notes.append(text)
    extra = [lab for n, lab in zip(names, mlabels) if n not in PAPER_AVERAGE]
    if extra and order[0] in extra:
        first = order[0]
        notes.append(f"{first} (not in CRT's table) ranks first here"
                     + (", as FAVOR# §5.2 reports SDERF's lead in its own kernel classification."
                        if first == "SDERF" else "."))
    widths = []
    for n, m in zip(names, methods):
        mech = kernels.get(n, **dict(m.options))
        widths.append(f"{m.label} {m.num_features} → {mech.feature_dim(m.num_features)}")
    notes.append(f"Random features per mechanism at a budget of {budget} real numbers (num_features → "
                 "feature width): " + ", ".join(widths) + ".")
    hrf = [m for n, m in zip(names, methods) if n.startswith("hrf-")]
    if hrf:
        notes.append(", ".join(f"{m.label} (m = {m.num_features})" for m in hrf)
                     + f": the hybrids' feature vectors are many times wider than m, so at {budget} numbers "
                     "they get few random projections; HRF's case is accuracy per projection, not per "
                     "feature width. Shown for completeness.")
    shifted = [m.label for n, m in zip(names, methods) if n in SHIFTED]
    if shifted:
        notes.append(f"{', '.join(shifted)}: shift c = min over the training split − ε with ε = {shift_eps:g}"
                     + (" (the paper's)" if shift_eps == PAPER_EPS else " (not the paper's 1e-8)")
                     + "; validation and test inputs are clamped at c + ε.")
    notes.append("The paper's rows are its UCI results (Table 1), for reference only: not the same data. "
                 f"Accuracies here are mean ± sd over {seeds} feature seeds (the paper's Table 3 gives its sd).")
    notes.append("Chosen σ per data set and method: " + "; ".join(
        f"{d}: " + ", ".join(f"{lab} {res[lab]['sigma']:.3g}" for lab in labels) for d, res in results.items()))
    return notes
