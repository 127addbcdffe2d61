"""CRT Table 1 / §9.10.2: non-parametric classification with the Gaussian kernel approximated by each
random-feature mechanism."""

from __future__ import annotations

import numpy as np

from favor import kernels
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
Poisson/geometric RFs. PoisRF+ and GeomRF+ take their shift c from the training split and clamp
validation and test inputs at c + 1e-8. The exact kernel's accuracy is the ceiling.

Where favor differs: the paper's eight UCI sets cannot be downloaded here; the default data are the
four sets that ship with scikit-learn (`--data` takes any other: an .npz with x and y, a CSV whose
last column is the label, or sklearn:<name>). Features are z-scored with the training split's
statistics. Every mechanism is fitted on the training split alone (the paper does not say; this
leaks no test data). GERF with complex A (s = −1) is not a favor mechanism; favor's real GERF at its
optimum is OPRF.
"""

PAPER_MECHS = ("trig", "positive", "poisson", "geometric", "oprf", "poisson+", "geometric+")
EXTRA_MECHS = ("saderf", "aderf", "sderf", "hrf-angular")
LABELS = {"trig": "TrigRF", "positive": "PosRF", "poisson": "PoisRF", "geometric": "GeomRF",
          "oprf": "OPRF", "poisson+": "PoisRF+", "geometric+": "GeomRF+", "saderf": "SADERF",
          "aderf": "ADERF", "sderf": "SDERF", "hrf-angular": "HRF-angular", "hrf-gaussian": "HRF-Gaussian",
          "gerf": "GERF (real)", "hrf-cluster": "HRF-cluster", "exact": "exact kernel"}
ORTHOGONAL = ("positive", "gerf", "oprf", "saderf", "aderf", "sderf")
# CRT Table 1 (test accuracy %, M = 128) for reference: its data sets are UCI's, not these
PAPER_TABLE = {
    "abalone": {"trig": 12.0, "positive": 16.0, "gerf": 17.0, "poisson": 18.0, "geometric": 18.3, "oprf": 17.1, "poisson+": 14.0, "geometric+": 15.1},
    "banknote": {"trig": 66.2, "positive": 83.4, "gerf": 92.4, "poisson": 84.4, "geometric": 94.5, "oprf": 92.6, "poisson+": 80.1, "geometric+": 85.6},
    "car": {"trig": 66.3, "positive": 69.2, "gerf": 70.9, "poisson": 66.3, "geometric": 66.3, "oprf": 69.5, "poisson+": 66.3, "geometric+": 67.2},
    "yeast": {"trig": 29.7, "positive": 34.4, "gerf": 42.9, "poisson": 36.9, "geometric": 35.9, "oprf": 44.4, "poisson+": 29.7, "geometric+": 31.0},
    "cmc": {"trig": 46.6, "positive": 45.1, "gerf": 47.8, "poisson": 46.6, "geometric": 47.3, "oprf": 46.3, "poisson+": 35.5, "geometric+": 43.5},
    "nursery": {"trig": 31.3, "positive": 77.4, "gerf": 63.8, "poisson": 77.1, "geometric": 77.1, "oprf": 78.9, "poisson+": 77.3, "geometric+": 71.0},
    "wifi": {"trig": 15.2, "positive": 88.8, "gerf": 93.3, "poisson": 95.3, "geometric": 95.8, "oprf": 93.3, "poisson+": 77.2, "geometric+": 82.9},
}


def add_arguments(parser):
    parser.add_argument("--data", action="append", default=None,
                        help="a data set: sklearn:<iris|wine|breast_cancer|digits>, x/y .npz or CSV "
                             "(repeatable; default the four scikit-learn sets; --quick sklearn:iris)")
    parser.add_argument("--mechanisms", default=None,
                        help="comma-separated mechanism names (default: the paper's seven and "
                             f"{', '.join(EXTRA_MECHS)}); any of: {', '.join(kernels.names())}")
    parser.add_argument("--seeds", type=int, default=None, help="feature seeds (default 50; --quick 5)")
    parser.add_argument("--budget", type=int, default=128, help="real numbers per feature vector (M)")


def methods_for(names, budget):
    out = []
    for name in names:
        coupling = "orthogonal" if name in ORTHOGONAL else "iid"
        out.append(classify.Method(LABELS.get(name, name), name,
                                   classify.budget_features(name, budget), coupling))
    return out


def mechanism_list(arg, quick):
    if arg is None:
        return ("trig", "positive", "oprf", "poisson+") if quick else PAPER_MECHS + EXTRA_MECHS
    names = tuple(n.strip() for n in arg.split(",") if n.strip())
    bad = [n for n in names if n not in kernels.names()]
    if bad or not names:
        raise ValueError(f"--mechanisms: unknown {', '.join(map(repr, bad)) or 'empty list'}; valid: "
                         f"{', '.join(kernels.names())}")
    return names


def run(args):
    quick = args.quick
    names = mechanism_list(args.mechanisms, quick)
    specs = args.data or (["sklearn:iris"] if quick else [f"sklearn:{n}" for n in classify.SKLEARN_SETS])
    seeds = args.seeds or (5 if quick else 50)
    sigmas = np.logspace(-2, 2, 4 if quick else 10)
    methods = methods_for(names, args.budget) + [classify.Method("exact kernel", None)]
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
    paper_labels = [LABELS[n] for n in PAPER_MECHS]
    for dname, accs in PAPER_TABLE.items():
        rows.append([f"paper: {dname} (UCI)"] + [f"{accs[n]:.1f}" if n in accs and LABELS[n] in paper_labels
                                                  else None for n in names] + [None, None])

    def avg(label):
        return float(np.mean([res[label]["mean"] for res in results.values()]))

    checks = []
    for dname, res in results.items():
        ceiling = res["exact kernel"]["mean"]
        ok = all(res[lab]["mean"] <= ceiling + 3 * res[lab]["sd"] / np.sqrt(seeds) + 1e-9
                 for lab in labels[:-1])
        checks.append((f"{dname}: no mechanism beats the exact kernel beyond 3 SE (ceiling "
                       f"{100 * ceiling:.1f} %)", ok))
    # The paper's orderings (TrigRF weakest on average, OPRF/GERF best) are about its UCI sets, and
    # they come mostly from two of them (nursery, wifi: TrigRF 31 and 15 % against 77-96 %); they are
    # not a property every data set shares, so they are reported below, not checked.
    order = sorted(labels[:-1], key=avg, reverse=True)
    notes = [
        "Ranking by mean accuracy here: " + " > ".join(f"{lab} {100 * avg(lab):.1f}" for lab in order)
        + f" (exact kernel {100 * avg('exact kernel'):.1f}) %.",
        "The paper's ranking on its seven UCI sets (means of the rows below): OPRF 63.2 > GeomRF 62.2 > "
        "GERF 61.2 > PoisRF 60.7 > PosRF 59.2 > GeomRF+ 56.6 > PoisRF+ 54.3 > TrigRF 38.2. Its orderings "
        "are about those sets, not checked here: TrigRF's last place comes from two of them (nursery "
        "and wifi, 31 and 15 % against 77–96 %); on scikit-learn's sets TrigRF is competitive (its "
        "Gaussian-kernel variance is bounded by ½, and the chosen σ are small). SDERF, not in CRT's "
        "table, ranks first here, as FAVOR# reports for its own kernel-regression experiment.",
        "HRF-angular at a budget of 128 numbers has m = 3 (its feature vector is 36m wide): it is shown "
        "for completeness; HRF's case is accuracy per random projection, not per feature width.",
        "The paper's rows are its UCI results, for reference only: not the same data.",
        "Chosen σ per data set and method: " + "; ".join(
            f"{d}: " + ", ".join(f"{lab} {res[lab]['sigma']:.3g}" for lab in labels) for d, res in results.items()),
    ]

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
        figures={"sigmas": sigmas, "seeds": seeds, "results": results})
