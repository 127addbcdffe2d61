"""FAVOR# (dense-exponential random features) Fig. 2: relative variance of GERF, SADERF, ADERF, SDERF."""

from __future__ import annotations

import numpy as np

from favor.repro import regimes
from favor.repro.report import Report

NAME = "favor-sharp-variance"
SUMMARY = "FAVOR# Fig. 2: log relative variance of PosRF, GERF, SADERF, ADERF, SDERF on four regimes"
PROTOCOL = """\
FAVOR# §5.1 (the setup of CRT §5.1): d = 64; for each regime and each of 10 scales σ evenly spaced in
[0.1, 1], two sets of L = 1024 vectors are drawn 5 times; every mechanism's parameters are fitted on
each pair of sets (the closed-form optimum of the shifted log-variance); the relative variance
Var / K² of one random feature's estimate is computed for all L² pairs by the analytic formulas.
Plotted and tabled: the mean over pairs and samples of log(Var / K²) (the same for the softmax and
the Gaussian kernel: the two estimators differ by a deterministic factor).

Where favor differs: the paper's GERF is favor's `oprf` (GERF at its optimal real A, the positive
GERF the FAVOR# paper compares with); regimes cifar10 and mnist/cifar10 are left out (CIFAR-10 cannot
be downloaded here) and mnist is scikit-learn's 8×8 digits (two disjoint sets of 898). This copy of the FAVOR# paper lost its
figure and its numbers ('about [lost] times better'), so the checks are the orderings the text
states: SDERF at or below PosRF and GERF everywhere and on par with ADERF and SADERF (within 128/L nats: their
two transforms, fitted on the sets they are scored on, win a finite-set margin that shrinks as 1/L),
ADERF and SADERF at or below GERF.
"""

MECHS = ("positive", "oprf", "saderf", "aderf", "sderf")
LABELS = {"positive": "PosRF", "oprf": "GERF (favor: oprf)", "saderf": "SADERF", "aderf": "ADERF",
          "sderf": "SDERF"}
TOL = 1e-3   # 'on par': a mean log relative variance within this of the other's counts as not worse


def add_arguments(parser):
    parser.add_argument("--set_size", type=int, default=None, help="L (default 1024; --quick 128)")
    parser.add_argument("--samples", type=int, default=None, help="pairs of sets (default 5; --quick 2)")


def run(args):
    d = 64
    size, samples, sigmas, rng = regimes.protocol(args, (0.1, 1.0))
    mean = {r: {m: [] for m in MECHS} for r in regimes.REGIMES}
    sd = {r: {m: [] for m in MECHS} for r in regimes.REGIMES}
    for regime in regimes.REGIMES:
        for sigma in sigmas:
            pooled = {m: [] for m in MECHS}
            for _ in range(samples):
                x, y = regimes.sample(regime, float(sigma), size, d, rng)
                log_k = np.asarray(x, np.float64) @ np.asarray(y, np.float64).T   # log SM(x, y)
                for m in MECHS:
                    lv = regimes.pair_log_variances(regimes.mechanism(m), x, y, gaussian=False)
                    pooled[m].append((lv - 2.0 * log_k).ravel())
            for m in MECHS:
                allv = np.concatenate(pooled[m])
                mean[regime][m].append(float(np.mean(allv)))
                sd[regime][m].append(float(np.std(allv)))

    # 'On par': (SA)DERF has two free transforms to SDERF's one, and all are fitted to the very sets
    # they are scored on, so on isotropic data ADERF wins by a finite-set margin that shrinks as 1/L
    # (normal, σ = 1: 0.9, 0.35, 0.19, 0.10 nats at L = 128, 256, 512, 1024; sphere a quarter of that).
    par = 128.0 / size
    rows, checks = [], []
    for regime in regimes.REGIMES:
        for i in (0, len(sigmas) // 2, len(sigmas) - 1):
            rows.append([regime, round(float(sigmas[i]), 2)] + [mean[regime][m][i] for m in MECHS])
        best = all(mean[regime]["sderf"][i] <= mean[regime][m][i] + TOL
                   for m in ("positive", "oprf") for i in range(len(sigmas)))
        checks.append((f"{regime}: SDERF at or below PosRF and GERF at every σ", best))
        gap = max(mean[regime]["sderf"][i] - mean[regime][m][i]
                  for m in ("saderf", "aderf") for i in range(len(sigmas)))
        checks.append((f"{regime}: SDERF on par with or below SADERF and ADERF at every σ (at most "
                       f"{par:.3g} above; favor: {gap:+.3g})", gap <= par))
        for m in ("aderf", "saderf"):
            ok = all(mean[regime][m][i] <= mean[regime]["oprf"][i] + TOL for i in range(len(sigmas)))
            checks.append((f"{regime}: {LABELS[m]} at or below GERF at every σ", ok))
    gains = {r: mean[r]["oprf"][-1] - mean[r]["sderf"][-1] for r in regimes.REGIMES}
    notes = [
        "Gain of SDERF over GERF at σ = 1 (difference of mean log relative variance, 'e^k times "
        "better'): " + ", ".join(f"{r} {g:.2f}" for r, g in gains.items()) + ". The paper's values "
        "were lost from this copy; it states SDERF is better than GERF by a large factor in heterogen "
        "and mnist and on par elsewhere.",
    ]

    for regime in regimes.REGIMES:
        idx = [i for i in range(len(sigmas)) if mean[regime]["sderf"][i] - mean[regime]["aderf"][i] > par]
        if idx:
            gaps = [mean[regime]["sderf"][i] - mean[regime]["aderf"][i] for i in idx]
            vals = [mean[regime]["sderf"][i] for i in idx]
            notes.append(
                f"{regime}: SDERF trails ADERF beyond the finite-set margin at σ = "
                + ", ".join(f"{sigmas[i]:.2g}" for i in idx) + f", by up to {max(gaps):.2f} nats on values "
                f"of {min(vals):.1f} to {max(vals):.1f}. "
                + ("x and y come from different distributions here, which ADERF's two transforms fit "
                   "and SDERF's one shared transform cannot; on the plot's scale the two are on par, "
                   "as the paper says, but the margin this check allows is only the finite-set one."
                   if regime == "heterogen" else ""))

    def plot(fig):
        axes = fig.subplots(1, 4)
        for ax, regime in zip(axes, regimes.REGIMES):
            for m in MECHS:
                mu, s = np.array(mean[regime][m]), np.array(sd[regime][m])
                (line,) = ax.plot(sigmas, mu, marker=".", label=LABELS[m],
                                  ls="--" if m == "saderf" else "-")
                ax.fill_between(sigmas, mu - s, mu + s, color=line.get_color(), alpha=0.1)
            ax.set_title(regime + (" (sklearn digits)" if regime == "mnist" else ""))
            ax.set_xlabel("σ (input scale)")
            ax.set_ylabel("mean log(Var / K²), one feature")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"FAVOR# Fig. 2 with favor's analytic variances (d = {d}, L = {size}, "
                     f"{samples} samples; mean ± sd over pairs)")

    return Report(
        title="favor-sharp-variance: FAVOR# Fig. 2 (relative variance of dense-exponential RFs)",
        protocol=PROTOCOL,
        columns=["regime", "σ"] + [f"{LABELS[m]} log(Var/K²)" for m in MECHS],
        rows=rows, checks=checks, notes=notes, plot=plot, figsize=(18, 4.8),
        figures={"sigmas": sigmas, "set_size": size, "samples": samples, "mean": mean, "sd": sd})
