"""'All random features representations are equivalent' (Theorem 1, Corollaries 1-2): the variance of
PosRF, OPRF and SDERF with and without favor's optimal Gaussian importance-sampling proposal."""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp

from favor.repro import regimes
from favor.repro.report import Report

NAME = "importance-sampling"
SUMMARY = "Equivalent-RF paper Thm 1 / Cor. 2: PosRF, OPRF, SDERF variance with and without optimal IS"
PROTOCOL = """\
The paper states theorems and runs no experiment; this reproduction tests them on the CRT regimes.
Kernel SM(x, y) = exp(xᵀy), d = 64. For each regime and each of 10 scales σ evenly spaced in
[0.05, 0.45], sets of L = 1024 vectors are drawn 5 times. Computed by favor's analytic formulas: the
expected sample variance V = mean over all L² pairs of the one-feature variance, for positive, oprf
and sderf, each with `importance_sampling` off and on (favor's proposal p_Ψ ∝ p_Ω·q_φ, Theorem 1's
optimum for Gaussian inputs with the sets' mean and covariance).
Reference lines, from the paper's formulas in plain float64:
- normal (x, y independent, both N(0, σ²I): X₁ = X₂ as distributions): Corollary 2's optimum of the
  population, (1 − 2σ²)^{−d} − (1 − 4σ⁴)^{−d/2};
- sphere and mnist (one set X on both sides, X₁ = X₂ the empirical distribution): Corollary 2's exact
  optimum over every proposal and representation, V* = (mean_i e^{||x_i||²})² − mean_ij e^{2x_iᵀx_j};
- heterogen (x ~ N(0, σ²I), y ~ N(σ·1, σ²I), X₁ ≠ X₂): Corollary 1's upper bound on the optimum,
  mean_i e^{||x_i||²} · mean_j e^{||y_j||²} − mean_ij e^{2x_iᵀy_j}.
σ stops at 0.45 (σ² < ¼): the sample mean over pairs estimates the population V with finite
variance only there (the optimum itself is finite up to σ² < ½).
"""

MECHS = ("positive", "oprf", "sderf")
LABELS = {"positive": "PosRF", "oprf": "OPRF", "sderf": "SDERF"}
SAME_SET = ("sphere", "mnist")   # one set on both sides: Corollary 2 gives the empirical optimum
TOL = 1e-3                                 # log-scale slack for float32 formulas


def add_arguments(parser):
    parser.add_argument("--set_size", type=int, default=None, help="L (default 1024; --quick 128)")
    parser.add_argument("--samples", type=int, default=None, help="sets drawn (default 5; --quick 2)")


def _log_mean_exp(a):
    a = np.asarray(a, np.float64).ravel()
    return float(logsumexp(a) - np.log(a.size))


def corollary_log_optimum(x, y):
    """log of mean_i e^{||x_i||²} · mean_j e^{||y_j||²} − mean_ij e^{2 x_iᵀ y_j}, float64: Corollary 2's
    optimal variance when y is x (the same empirical distribution), Corollary 1's bound otherwise."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    first = _log_mean_exp(np.sum(x * x, -1)) + _log_mean_exp(np.sum(y * y, -1))
    second = _log_mean_exp(2.0 * x @ y.T)
    return first + np.log1p(-np.exp(second - first))


def run(args):
    d = 64
    size, samples, sigmas, rng = regimes.protocol(args, (0.05, 0.45))
    variants = [(m, is_) for m in MECHS for is_ in (False, True)]
    logv = {r: {f"{m}{'+IS' if s else ''}": [] for m, s in variants} for r in regimes.REGIMES}
    ref = {r: [] for r in regimes.REGIMES}
    for regime in regimes.REGIMES:
        for sigma in sigmas:
            per = {k: [] for k in logv[regime]}
            refs = []
            for _ in range(samples):
                x, y = regimes.sample(regime, float(sigma), size, d, rng)
                if regime in SAME_SET:
                    y = x
                refs.append(corollary_log_optimum(x, y))
                for m, s in variants:
                    mech = regimes.mechanism(m, importance_sampling=s)
                    lv = regimes.pair_log_variances(mech, x, y, gaussian=False)
                    per[f"{m}{'+IS' if s else ''}"].append(_log_mean_exp(lv))
            for k in per:
                logv[regime][k].append(float(np.mean(per[k])))
            ref[regime].append(float(np.mean(refs)))
    population = [float(-d * np.log1p(-2 * s**2)
                        + np.log1p(-np.exp(-0.5 * d * np.log1p(-4 * s**4) + d * np.log1p(-2 * s**2))))
                  for s in sigmas]
    ref["normal"] = population    # the normal regime's reference is the population optimum

    rows, checks = [], []
    n = len(sigmas)
    for regime in regimes.REGIMES:
        for i in (0, n // 2, n - 1):
            rows.append([regime, round(float(sigmas[i]), 3)]
                        + [logv[regime][k][i] for k in logv[regime]] + [ref[regime][i]])
        spread = max(max(logv[regime][m + "+IS"][i] for m in MECHS)
                     - min(logv[regime][m + "+IS"][i] for m in MECHS) for i in range(n))
        checks.append((f"{regime}: with the optimal proposal PosRF, OPRF and SDERF have the same variance "
                       f"(spread of log V ≤ 0.01; favor {spread:.2g})", spread <= 0.01))
        for m in ("positive", "oprf"):
            ok = all(logv[regime][m + "+IS"][i] <= logv[regime][m][i] + TOL for i in range(n))
            checks.append((f"{regime}: {LABELS[m]} with IS at or below without (every σ)", ok))
    for regime in SAME_SET:
        gap = min(logv[regime][m + "+IS"][i] - ref[regime][i] for m in MECHS for i in range(n))
        checks.append((f"{regime}: no variance below Corollary 2's optimum V* (smallest log V − log V* "
                       f"{gap:+.2g})", gap >= -TOL))
    notes = [
        "With the optimal proposal the three representations give one variance (the paper's claim) in "
        "every regime, to float32 rounding; without it they differ by up to "
        + ", ".join(f"{r} {max(max(logv[r][m][i] for m in MECHS) - min(logv[r][m][i] for m in MECHS) for i in range(n)):.2g}"
                    for r in regimes.REGIMES) + " nats.",
        "favor's proposal is Theorem 1's optimum for Gaussian inputs. On normal its V follows the "
        "population optimum (the mean over L² pairs of a heavy-tailed variance falls a little below it "
        "at the larger σ); on sphere and mnist (not Gaussian) it stays just above the empirical optimum "
        "V*, which only a proposal fitted to the set itself (a mixture, not a Gaussian) would reach.",
        "SDERF without IS is not checked against SDERF with IS: its dense transform is fitted to the very "
        "sets it is scored on, and on normal and heterogen at larger σ that in-sample fit beats the "
        "population-optimal proposal (Theorem 1 orders the two in expectation over the population, "
        "not on the sets a φ was fitted to). PosRF has no fit and OPRF one scalar: both are checked.",
        "Why normal uses two independent sets: with one set on both sides the L diagonal pairs (x_i, x_i) "
        "carry ||2x_i||², twice an independent pair's, and their e^{c·||x_i + x_j||²} terms dominate the "
        "mean over pairs at σ ≳ 0.2: a Gaussian proposal for N(0, σ²I) is not fitted to them (log V − "
        "log V* reached 33 nats at σ = 0.45 that way).",
    ]

    def plot(fig):
        axes = fig.subplots(1, 4)
        for ax, regime in zip(axes, regimes.REGIMES):
            for j, m in enumerate(MECHS):
                c = f"C{j}"
                ax.plot(sigmas, logv[regime][m], color=c, ls="--", marker=".", label=f"{LABELS[m]}")
                ax.plot(sigmas, logv[regime][m + "+IS"], color=c, ls="-", marker="o", ms=3,
                        label=f"{LABELS[m]} + optimal IS")
            label = {"normal": "Cor. 2 population optimum", "heterogen": "Cor. 1 bound on the optimum"}
            ax.plot(sigmas, ref[regime], color="black", lw=2.5 if regime == "normal" else 1.2, alpha=0.6,
                    ls=":" if regime == "heterogen" else "-", label=label.get(regime, "Cor. 2 optimum V* (this set)"))
            title = {"normal": "normal (x, y independent)", "heterogen": "heterogen (X₁ ≠ X₂)",
                     "sphere": "sphere (one set, X₁ = X₂)", "mnist": "mnist, sklearn digits (one set)"}
            ax.set_title(title[regime], fontsize=9)
            ax.set_xlabel("σ (input scale)")
            ax.set_ylabel("log V (mean one-feature variance of exp(xᵀy))")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        fig.suptitle(f"Importance sampling (Theorem 1) makes the representation irrelevant: d = {d}, "
                     f"L = {size}, {samples} samples. Dashed: sampling ω from N(0, I); solid: from the "
                     "optimal proposal (the three solid curves coincide)")

    cols = [f"{LABELS[m]}{' + IS' if s else ''}" for m, s in variants]
    return Report(
        title="importance-sampling: variance with and without the optimal proposal (log V)",
        protocol=PROTOCOL,
        columns=["regime", "σ"] + cols + ["V* (Cor. 2) / Cor. 1 bound"],
        rows=rows, checks=checks, notes=notes, plot=plot, figsize=(18, 4.8),
        figures={"sigmas": sigmas, "set_size": size, "samples": samples, "log_v": logv,
                 "reference": ref, "population": population})
