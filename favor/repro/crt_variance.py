"""CRT (Chefs' Random Tables, FAVOR++) Fig. 1-right and Fig. 2: analytic log-variance of the random-feature
mechanisms for the Gaussian kernel."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from scipy.special import logsumexp

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
(mnist, where trig is good: similar images are nearly parallel) favor cannot reproduce the claim.
PoisRF+ and GeomRF+ use ε = 1e-8 in their shift c = min − ε (the paper's value in §9.10.2; favor's
library default is 1e-2; the difference is below 0.3 nats here, see the table).

GeomRF+ falls short of the paper's figures; the table's lower part is the investigation, at σ = 1 on
the first pair of sets: GeomRF+ with favor's library ε = 1e-2, at the p that minimises the exact mean
log-variance on a grid of 30 values in [0.005, 0.9] (instead of the eq. 13-14 surrogate), with its
shift c taken from smaller sets (L = 8 and 64, 5 samples each: c is the minimum over both sets, so
it moves away from 0 as L grows, and GeomRF+'s variance with it), and the gains as log of the mean
variance instead of mean log-variance (the other normalisation the paper's words allow).
"""

NON_POSITIVE = ("trig", "poisson", "geometric")
POSITIVE = ("positive", "oprf", "poisson+", "geometric+")
LABELS = {"trig": "TrigRF", "positive": "PosRF", "oprf": "OPRF", "poisson": "PoisRF",
          "poisson+": "PoisRF+", "geometric": "GeomRF", "geometric+": "GeomRF+"}
# The paper's gains at σ = 1 (§5.1), as log-variance differences: (regime, better, baseline) -> > value
SHIFT_EPS = 1e-8   # CRT §9.10.2's ε for PoisRF+ / GeomRF+ (favor's kernels default to 1e-2)
P_GRID = np.concatenate([[0.005], np.linspace(0.02, 0.9, 29)])
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


def mech(name, **options):
    """The mechanism of a curve: the shifted variants with the paper's ε unless told otherwise."""
    if name in ("poisson+", "geometric+"):
        options.setdefault("shift_eps", SHIFT_EPS)
    return regimes.mechanism(name, **options)


def mu_curve(v, d):
    """Fig. 1-right: log Var_OPRF − log Var_PosRF at x = y = (√v / 2)·e₁ (so ||x + y||² = v), each
    fitted on that pair; the ratio is the same for the softmax and the Gaussian kernel."""
    x = np.zeros((1, d), np.float32)
    x[0, 0] = np.sqrt(v) / 2.0
    lv = {m: regimes.pair_log_variances(regimes.mechanism(m), x, x)[0, 0] for m in ("oprf", "positive")}
    return lv["oprf"] - lv["positive"]


def _gain_vs_positive(x, y, geo, params=None):
    """Mean log-variance of PosRF minus that of GeomRF+ (`geo`, optionally at `params`) on x, y."""
    pos = regimes.pair_log_variances(regimes.mechanism("positive"), x, y)
    return float(np.mean(pos) - np.mean(regimes.pair_log_variances(geo, x, y, params=params)))


def investigate_geometric_plus(first_sets, d, rng, quick):
    """Why GeomRF+ falls short of the paper's gains (σ = 1, normal and heterogen): its gain over PosRF
    on the first pair of sets at the fitted p (ε = 1e-8 and favor's 1e-2), at the best p of a grid
    (the exact mean log-variance, not the surrogate), and with the shift c from smaller sets."""
    out = {}
    geo = mech("geometric+")
    grid = P_GRID[::6] if quick else P_GRID
    for regime in ("normal", "heterogen"):
        x, y = first_sets[regime]
        xj, yj = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        params = geo.fit(xj, yj)
        fit = _gain_vs_positive(x, y, geo, params)
        eps2 = _gain_vs_positive(x, y, regimes.mechanism("geometric+"))
        by_p = [_gain_vs_positive(x, y, geo, dataclasses.replace(params, rate=jnp.full_like(params.rate, p)))
                for p in grid]
        k = int(np.argmax(by_p))
        small_all = {}
        for small in (8, 64):
            small_all[small] = [_gain_vs_positive(*regimes.sample(regime, 1.0, small, d, rng), geo)
                                for _ in range(2 if quick else 5)]
        out[regime] = {"p_fit": float(params.rate), "fit": fit, "eps_1e-2": eps2, "p_grid": grid,
                       "gain_by_p": by_p, "p_best": float(grid[k]), "best_p": by_p[k],
                       "shift_mean": float(jnp.mean(params.shift)),
                       "small_sets_all": small_all,
                       "small_sets": {s_: float(np.mean(v)) for s_, v in small_all.items()}}
    return out


def _geometric_note(stats, probe, last):
    """The GeomRF+ finding, from this run's figures."""
    rs = ("normal", "heterogen")
    paper = {r: PAPER_GAINS[(r, "geometric+", "positive")] for r in rs}
    g = {r: stats[r]["positive"]["mean"][last] - stats[r]["geometric+"]["mean"][last] for r in rs}
    lm = {r: {m: stats[r][m]["log_mean"][last] for m in ("positive", "geometric+", "oprf", "trig")} for r in rs}

    def two(value, fmt, pre=""):   # "normal / heterogen"
        return " / ".join(pre + format(value(r), fmt) for r in rs)

    pr = probe
    short = [r for r in rs if g[r] <= paper[r]]
    text = (f"GeomRF+ vs PosRF at σ = 1: e^{g['normal']:.1f} (normal) and e^{g['heterogen']:.1f} (heterogen), "
            f"paper > e^{paper['normal']} and > e^{paper['heterogen']}: "
            + (f"short on {' and '.join(short)}. " if short else "both reached in this run. ")
            + "Checked on the first pair of sets at σ = 1 (table, lower part; figures normal / heterogen): "
            "favor's p, fitted by the eq. 13-14 surrogate (" + two(lambda r: pr[r]["p_fit"], ".3f")
            + "), is near-optimal: the best of " + str(len(pr["normal"]["p_grid"]))
            + " p in [0.005, 0.9], scored by the exact mean log-variance, changes the gain by "
            + two(lambda r: pr[r]["best_p"] - pr[r]["fit"], "+.1f") + " nats; ε = 1e-8 instead of 1e-2 by "
            + two(lambda r: pr[r]["fit"] - pr[r]["eps_1e-2"], "+.2f") + " nats. The variance formula is "
            "Theorem 3.5's eq. 13 (favor's tests check it by Monte Carlo; a float64 evaluation of eq. 13 "
            "written outside favor gave the same gains to 0.1 nats). What moves the gain is the shift "
            "c = min over both sets − ε: it falls with L (mean c = " + two(lambda r: pr[r]["shift_mean"], ".2f")
            + " here), and the shifted inputs, and I₀(2|x̂_l ŷ_l|/√(1−p)) with them, grow with |c|. With c "
            "from sets of L = 64 the gain is " + two(lambda r: pr[r]["small_sets"][64], ".1f", "e^")
            + ", with L = 8 " + two(lambda r: pr[r]["small_sets"][8], ".1f", "e^") + ".")
    reach = [r for r in rs if max(pr[r]["small_sets"].values()) > paper[r]]
    if short:
        text += (" Smaller sets reach the paper's figure on " + (" and ".join(reach) or "neither regime")
                 + "; under the paper's stated protocol (L = 1024, c from the sets) favor does not reproduce "
                 "it on " + " and ".join(short) + ".")
    text += (" Nor does the other normalisation explain it: as log of the mean variance GeomRF+'s gain "
             "would be " + two(lambda r: lm[r]["positive"] - lm[r]["geometric+"], ".0f", "e^")
             + ", but OPRF's gain over TrigRF would then be " + two(lambda r: lm[r]["trig"] - lm[r]["oprf"], ".1f", "e^")
             + ", far from the paper's > e^80 / > e^125, which the mean log-variance reproduces. The paper "
             "lists OPRF and GeomRF+ together; favor's figures support the claim for OPRF"
             + (" only." if short else "."))
    return text


def run(args):
    quick = args.quick
    d = args.dim
    size, samples, sigmas, rng = regimes.protocol(args, (0.1, 1.0))
    mechs = NON_POSITIVE + POSITIVE
    stats = {r: {m: {"mean": [], "sd": [], "log_mean": []} for m in mechs} for r in regimes.REGIMES}
    first_sets = {}   # regime -> the first pair of sets at σ = 1 (the investigation's)
    for regime in regimes.REGIMES:
        for sigma in sigmas:
            pooled = {m: [] for m in mechs}
            for s in range(samples):
                x, y = regimes.sample(regime, float(sigma), size, d, rng)
                if s == 0 and sigma == sigmas[-1]:
                    first_sets[regime] = (x, y)
                for m in mechs:
                    lv = regimes.pair_log_variances(mech(m), x, y)
                    # two real numbers per feature: one trig frequency, two samples of the rest
                    pooled[m].append(lv if m == "trig" else lv - regimes.LOG2)
            for m in mechs:
                allv = np.concatenate([p.ravel() for p in pooled[m]])
                stats[regime][m]["mean"].append(float(np.mean(allv)))
                stats[regime][m]["sd"].append(float(np.std(allv)))
                stats[regime][m]["log_mean"].append(float(logsumexp(allv) - np.log(allv.size)))
    probe = investigate_geometric_plus(first_sets, d, rng, quick)

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
            agrees = "✓ (lower bound)" if g > paper else \
                "✗ not reproduced: favor's real GERF (OPRF) is worse; the complex s = −1 branch is not in favor"
            rows.append([regime, f"OPRF (for GERF) vs {LABELS[base]}", f"> {paper}", round(g, 1), agrees])
        else:
            rows.append([regime, f"{LABELS[better]} vs {LABELS[base]}", f"> {paper}", round(g, 1),
                         "✓" if g > paper else "✗"])
    for regime in regimes.REGIMES:
        # orderings with a wide margin at σ = 1 in every regime, which the paper's Fig. 2 shows
        checks.append((f"{regime}, σ = 1: OPRF below PosRF", gain(regime, "oprf", "positive") > 0))
    rows.append(["(Fig. 1-right)", "μ(v = 100, d = 64) = log Var OPRF − log Var PosRF", "< −60",
                 round(mu_100_64, 1), "✓" if mu_100_64 < -60 else "✗"])
    for regime in ("normal", "heterogen"):
        pr = probe[regime]
        paper = PAPER_GAINS[(regime, "geometric+", "positive")]
        rows.append([f"{regime} (why GeomRF+?)", f"GeomRF+ vs PosRF, this sample: fitted p = {pr['p_fit']:.3f}, ε = 1e-8",
                     f"> {paper}", round(pr["fit"], 1), "✓" if pr["fit"] > paper else "✗"])
        rows.append([f"{regime} (why GeomRF+?)", "… with favor's library ε = 1e-2", f"> {paper}",
                     round(pr["eps_1e-2"], 1), "✓" if pr["eps_1e-2"] > paper else "✗"])
        rows.append([f"{regime} (why GeomRF+?)", f"… at the best of {len(pr['p_grid'])} p on a grid (p = {pr['p_best']:.3f})",
                     f"> {paper}", round(pr["best_p"], 1), "✓" if pr["best_p"] > paper else "✗"])
        for small, g in pr["small_sets"].items():
            rows.append([f"{regime} (why GeomRF+?)", f"… with sets of L = {small} (c nearer 0; mean of "
                         f"{len(pr['small_sets_all'][small])})", f"> {paper}", round(g, 1),
                         "✓" if g > paper else "✗"])
        lm = {m: stats[regime][m]["log_mean"][last] for m in ("positive", "geometric+", "oprf", "trig")}
        rows.append([f"{regime} (normalisation)", "log of mean variance: GeomRF+ vs PosRF / OPRF vs TrigRF",
                     f"> {paper} / > {PAPER_GAINS[(regime, 'oprf', 'trig')]}",
                     f"{lm['positive'] - lm['geometric+']:.1f} / {lm['trig'] - lm['oprf']:.1f}", "(see notes)"])

    notes = [
        "Gains are differences of the mean log-variance at σ = 1 (the paper's 'e^k times smaller "
        "variance'; Fig. 2 plots the mean and sd of the log-variance). Gaussian vs softmax kernel and "
        "the M = 2 budget shift every mechanism's log-variance alike, so they cannot change a gain.",
        _geometric_note(stats, probe, last),
        "The mnist rows use scikit-learn's digits, not MNIST: their pixel statistics differ (digits "
        "are 17 grey levels of thicker strokes), so the mnist gains are comparable in sign and order, "
        "not in value. The paper's 'GERF > e^10 better than TrigRF' on mnist is not reproduced: favor's "
        f"best real GERF (OPRF, the s = +1 optimum) is e^{-gain('mnist', 'oprf', 'trig'):.1f} worse "
        "than TrigRF there, and the complex s = −1 branch, which the paper's GERF can pick and which "
        "behaves like TrigRF on nearly parallel inputs, is not a favor mechanism.",
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
                _mark_paper(ax, regime, row, stats, sigmas)
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
                 "mu": {"v": vs, **{str(k): v for k, v in mu.items()}}, "mu_100_64": mu_100_64,
                 "shift_eps": SHIFT_EPS, "geometric_plus_probe": probe})


def _mark_paper(ax, regime, row, stats, sigmas):
    """The paper's σ = 1 claims as markers: the level its gain puts the better mechanism at or below
    (baseline's favor value − the paper's gain), with favor's value of that mechanism beside it."""
    s1 = float(sigmas[-1])
    if row == 0:
        key, who = (regime, "oprf", "trig"), "GERF"
    else:
        key, who = (regime, "oprf", "positive"), "OPRF, GeomRF+"
    if key not in PAPER_GAINS:
        return
    paper = PAPER_GAINS[key]
    base = stats[regime][key[2]]["mean"][-1]
    level = base - paper
    ax.plot([s1], [level], marker="v", ms=9, color="red", ls="none", zorder=5,
            label=f"paper, σ = 1: {who} at or below this\n(> e^{paper} under favor's {LABELS[key[2]]})")
    if row == 0:   # favor's real GERF (OPRF) at σ = 1, for the GERF claim
        ax.plot([s1], [stats[regime]["oprf"]["mean"][-1]], marker="x", ms=8, color="black", ls="none",
                zorder=5, label="favor's real GERF (OPRF), σ = 1")
