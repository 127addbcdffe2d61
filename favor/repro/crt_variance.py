"""CRT (Chefs' Random Tables, FAVOR++) Fig. 1-right and Fig. 2: analytic log-variance of the random-feature
mechanisms for the Gaussian kernel."""

from __future__ import annotations

import numpy as np

from favor.repro import regimes
from favor.repro.report import Report

NAME = "crt-variance"
SUMMARY = "CRT Fig. 1-2: log-variance of TrigRF, PosRF, OPRF, PoisRF(+), GeomRF(+) on four regimes"
PROTOCOL = """\
CRT §5.1 / §9.10.1. d = 64. For each regime (normal, sphere, heterogen, mnist) and each of 10 scales
σ evenly spaced in [0.1, 1], two sets of L = 1024 vectors are drawn 5 times; each data-dependent
mechanism is fitted on the two sets (its closed-form parameters), and the analytic variance of the
Gaussian-kernel estimate is computed for all L² pairs. Plotted: mean ± sd of the log-variance over
all pairs and samples, at a budget of two real numbers per random feature as in the paper: one
frequency (sin, cos) of TrigRF, two samples of every real mechanism (log-variance − log 2).
Fig. 1-right: μ = log(Var OPRF / Var PosRF) at x = y with ||x + y||² = v, for d ∈ {16, 32, 64, 128}.

Where favor differs: the mnist regime uses scikit-learn's 8×8 digits (MNIST cannot be downloaded
here), two disjoint sets of 898 images (1797 in all); GERF with complex A (the paper's non-positive GERF, s = −1) is not a favor mechanism: favor's
GERF family is the real, positive branch (s = +1) whose optimum is OPRF, so the paper's 'GERF vs
TrigRF' claim is reported with OPRF in GERF's place: the paper's GERF takes the better of its s = −1
and s = +1 optima (§9.10.1), so OPRF's gain is a lower bound on GERF's. Where that bound falls short
(mnist, where trig is good: similar images are nearly parallel) the claim is neither confirmed nor
refuted.
"""

NON_POSITIVE = ("trig", "poisson", "geometric")
POSITIVE = ("positive", "oprf", "poisson+", "geometric+")
LABELS = {"trig": "TrigRF", "positive": "PosRF", "oprf": "OPRF", "poisson": "PoisRF",
          "poisson+": "PoisRF+", "geometric": "GeomRF", "geometric+": "GeomRF+"}
# The paper's gains at σ = 1 (§5.1), as log-variance differences: (regime, better, baseline) -> > value
PAPER_GAINS = {("normal", "oprf", "positive"): 75, ("heterogen", "oprf", "positive"): 125,
               ("mnist", "oprf", "positive"): 7,
               ("normal", "geometric+", "positive"): 75, ("heterogen", "geometric+", "positive"): 125,
               ("mnist", "geometric+", "positive"): 7,
               ("normal", "oprf", "trig"): 80, ("heterogen", "oprf", "trig"): 125,
               ("mnist", "oprf", "trig"): 10}


def add_arguments(parser):
    parser.add_argument("--dim", type=int, default=64, help="d (the mnist regime needs 64)")
    parser.add_argument("--set_size", type=int, default=None, help="L (default 1024; --quick 128)")
    parser.add_argument("--samples", type=int, default=None, help="pairs of sets (default 5; --quick 2)")


def mu_curve(v, d):
    """Fig. 1-right: log Var_OPRF − log Var_PosRF at x = y = (√v / 2)·e₁ (so ||x + y||² = v), each
    fitted on that pair; the ratio is the same for the softmax and the Gaussian kernel."""
    x = np.zeros((1, d), np.float32)
    x[0, 0] = np.sqrt(v) / 2.0
    lv = {m: regimes.pair_log_variances(regimes.mechanism(m), x, x)[0, 0] for m in ("oprf", "positive")}
    return lv["oprf"] - lv["positive"]


def run(args):
    quick = args.quick
    d = args.dim
    size, samples, sigmas, rng = regimes.protocol(args, (0.1, 1.0))
    mechs = NON_POSITIVE + POSITIVE
    stats = {r: {m: {"mean": [], "sd": []} for m in mechs} for r in regimes.REGIMES}
    for regime in regimes.REGIMES:
        for sigma in sigmas:
            pooled = {m: [] for m in mechs}
            for _ in range(samples):
                x, y = regimes.sample(regime, float(sigma), size, d, rng)
                for m in mechs:
                    lv = regimes.pair_log_variances(regimes.mechanism(m), x, y)
                    # two real numbers per feature: one trig frequency, two samples of the rest
                    pooled[m].append(lv if m == "trig" else lv - regimes.LOG2)
            for m in mechs:
                allv = np.concatenate([p.ravel() for p in pooled[m]])
                stats[regime][m]["mean"].append(float(np.mean(allv)))
                stats[regime][m]["sd"].append(float(np.std(allv)))

    vs = np.linspace(1.0, 200.0, 40 if not quick else 8)
    dims = (16, 32, 64, 128)
    mu = {dd: [float(mu_curve(v, dd)) for v in vs] for dd in dims}
    mu_100_64 = float(mu_curve(100.0, 64))

    last = -1   # σ = 1
    def gain(regime, better, base):
        return stats[regime][base]["mean"][last] - stats[regime][better]["mean"][last]

    rows, checks = [], []
    checks.append((f"OPRF has > e^60 times smaller variance than PosRF at d = 64, ||x+y||² = 100 "
                   f"(favor: e^{-mu_100_64:.1f})", mu_100_64 < -60))
    for (regime, better, base), paper in PAPER_GAINS.items():
        g = gain(regime, better, base)
        if base == "trig":   # OPRF stands in for GERF: its gain is a lower bound on GERF's
            agrees = "✓ (lower bound)" if g > paper else "– (not shown: GERF's complex branch is not in favor)"
            rows.append([regime, f"OPRF (for GERF) vs {LABELS[base]}", f"> {paper}", round(g, 1), agrees])
        else:
            rows.append([regime, f"{LABELS[better]} vs {LABELS[base]}", f"> {paper}", round(g, 1),
                         "✓" if g > paper else "✗"])
    for regime in regimes.REGIMES:
        # orderings with a wide margin at σ = 1 in every regime, which the paper's Fig. 2 shows
        checks.append((f"{regime}, σ = 1: OPRF below PosRF", gain(regime, "oprf", "positive") > 0))
    rows.append(["(Fig. 1-right)", "μ(v = 100, d = 64) = log Var OPRF − log Var PosRF", "< −60",
                 round(mu_100_64, 1), "✓" if mu_100_64 < -60 else "✗"])

    notes = [
        "Gains are differences of the mean log-variance at σ = 1 (the paper's 'e^k times smaller "
        "variance'). Where GeomRF+ falls short of the paper's figures: favor's geometric p minimises "
        "the paper's own surrogate (eq. 13 at the averaged |x_l y_l| of eq. 14); the exact variance at "
        "that p is what is plotted; at σ = 1 on normal it is e^18 above OPRF's. The paper lists OPRF and "
        "GeomRF+ together; favor's figures support the claim for OPRF.",
        "The mnist rows use scikit-learn's digits, not MNIST: their pixel statistics differ (digits "
        "are 17 grey levels of thicker strokes), so the mnist gains are comparable in sign and order, "
        "not in value.",
    ]

    def plot(fig):
        axes = fig.subplots(2, 5)
        for col, regime in enumerate(regimes.REGIMES):
            for row, group in enumerate((NON_POSITIVE, POSITIVE)):
                ax = axes[row, col]
                for m in group:
                    mean = np.array(stats[regime][m]["mean"])
                    sd = np.array(stats[regime][m]["sd"])
                    (line,) = ax.plot(sigmas, mean, label=LABELS[m], marker=".")
                    ax.fill_between(sigmas, mean - sd, mean + sd, color=line.get_color(), alpha=0.15)
                ax.set_title(f"{regime}: {'non-positive' if row == 0 else 'positive'} RFs", fontsize=9)
                ax.set_xlabel("σ (input scale)")
                if col == 0:
                    ax.set_ylabel("log Var (Gaussian kernel)")
                ax.legend(fontsize=7)
                ax.grid(alpha=0.3)
        ax = axes[0, 4]
        for dd in dims:
            ax.plot(vs, mu[dd], label=f"d = {dd}")
        ax.axvline(100, color="grey", lw=0.5)
        ax.axhline(-60, color="red", lw=0.8, ls="--", label="paper: < −60 at v = 100, d = 64")
        ax.set_title("Fig. 1-right: μ = log(Var OPRF / Var PosRF)", fontsize=9)
        ax.set_xlabel("v = ||x + y||²")
        ax.set_ylabel("μ (log variance ratio)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        axes[1, 4].axis("off")
        axes[1, 4].text(0.0, 0.5, "Mean ± sd over all L² pairs\nand samples; 2 real numbers\n"
                        "per feature (one trig frequency,\ntwo samples of real RFs).\n"
                        f"mnist: sklearn 8×8 digits / 16,\ntwo disjoint sets of {regimes.mnist_size(size)}.",
                        fontsize=8, va="center")
        fig.suptitle(f"CRT Fig. 2 (d = {d}, L = {size}, {samples} samples) and Fig. 1-right, "
                     "computed with favor's analytic variances")

    return Report(
        title="crt-variance: CRT Fig. 1-right and Fig. 2 (analytic log-variance)",
        protocol=PROTOCOL,
        columns=["regime", "comparison at σ = 1", "paper (log gain)", "favor (log gain)", "agrees"],
        rows=rows, checks=checks, notes=notes, plot=plot, figsize=(20, 8),
        figures={"sigmas": sigmas, "dim": d, "set_size": size, "samples": samples, "stats": stats,
                 "mu": {"v": vs, **{str(k): v for k, v in mu.items()}}, "mu_100_64": mu_100_64})
