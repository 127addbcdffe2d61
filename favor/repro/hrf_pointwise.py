"""HRF (Hybrid random features) Fig. 2: pointwise estimates of SM(x, y) over the angle between x and y."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from favor.repro import regimes
from favor.repro.report import Report
from favor.repro.sampling import repeated_estimates

NAME = "hrf-pointwise"
SUMMARY = "HRF Fig. 2: 5th/95th percentiles and relative error of FAVOR+, trig, HRF over angles"
PROTOCOL = """\
HRF §4 (Fig. 2). x = r·e₁ and y = r·(cos θ e₁ + sin θ e₂) in d = 64, r ∈ {1, 1.5}, 60 angles θ in
[0, π]; for each, 10,000 independent draws of each estimator give the 5th and 95th percentiles of
the estimate (beside the true SM(x, y) = e^{r² cos θ}) and the empirical relative error
√(mean (Ŝ − SM)²) / SM, drawn over the analytic one: HRF Lemma 2.2 for FAVOR+ (antithetic positive
RFs, favor's `positive` with antithetic=True) and trig, Theorem 3.1 with Lemma 3.2 for the angular
hybrid, Theorem 3.1 with the Gaussian λ's moments for the Gaussian hybrid. Trig and FAVOR+ use
m = 128 random features as in the paper; the hybrids use the m (and n = 8 λ-features) whose feature
map costs about the same FLOPs (projections and tensor products counted; the paper: 'similar number
of FLOPS per random feature map creation'): m = 48 (angular), m = 40 (Gaussian).
"""

D = 64
ANGLES = 60
METHODS = {   # label -> (mechanism, options, m)
    "FAVOR+": ("positive", {"antithetic": True}, 128),
    "trig": ("trig", {}, 128),
    "HRF-angular": ("hrf-angular", {"num_lambda_features": 8}, 48),
    "HRF-Gaussian": ("hrf-gaussian", {"num_lambda_features": 8}, 40),
}
FLOAT32_FLOOR = 1e-5   # relative size of float32 rounding in an estimate: its square floors the MSE


def add_arguments(parser):
    parser.add_argument("--estimates", type=int, default=None,
                        help="draws per angle (default 10000; --quick 1000)")


def lemma34_max_rel_error(r, m):
    """HRF Lemma 3.4: the largest relative error of trig and FAVOR+ on the sphere of radius r."""
    return math.sqrt(1.0 / (2 * m)) * math.exp(2 * r * r) * (1.0 - math.exp(-4 * r * r))


def theorem35_bound(r, m, n):
    """HRF Theorem 3.5: bound on the angular hybrid's largest relative error (r ≥ 1)."""
    return (lemma34_max_rel_error(r, m) / r
            * math.sqrt(1 / math.pi - 1 / (n * math.pi) + 1 / (n * math.sqrt(math.pi))))


def run(args):
    estimates = args.estimates or (1000 if args.quick else 10000)
    thetas = np.linspace(0.0, np.pi, 20 if args.quick else ANGLES)
    radii = (1.0, 1.5)
    out = {}
    checks = []
    for r in radii:
        x = np.zeros((1, D), np.float32)
        x[0, 0] = r
        y = np.zeros((len(thetas), D), np.float32)
        y[:, 0], y[:, 1] = r * np.cos(thetas), r * np.sin(thetas)
        true = np.exp(r * r * np.cos(thetas))
        xj, yj = jnp.asarray(x), jnp.asarray(y)
        for label, (name, opts, m) in METHODS.items():
            mech = regimes.mechanism(name, **opts)
            params = mech.fit(xj, yj)
            est = repeated_estimates(mech, xj, yj, params, m, estimates, seed=args.seed,
                                     chunk=min(estimates, 1000))[:estimates, 0, :]
            sq = (est - true) ** 2
            mse, se = sq.mean(0), sq.std(0, ddof=1) / math.sqrt(estimates)
            analytic = np.asarray(mech.variance(xj, yj, params, m), np.float64)[0]
            z = np.abs(mse - analytic) / (se + (FLOAT32_FLOOR * true) ** 2)
            # A z-test needs the squared error's spread to be estimable from the draws: trig's estimate
            # is bounded, but a positive block's squared error has kurtosis growing like e^{4||x+y||²},
            # and past ||x + y|| = 1.5 the sample mean of 10,000 draws usually falls below the MSE
            # (as in simrf-mse). There the empirical curve is drawn, not tested.
            tested = np.ones_like(thetas, bool) if name == "trig" else \
                np.sqrt(2 * r * r * (1 + np.cos(thetas))) <= 1.5
            z = z[tested]
            out[(r, label)] = {"p5": np.percentile(est, 5, axis=0), "p95": np.percentile(est, 95, axis=0),
                               "true": true, "rel_err": np.sqrt(mse) / true,
                               "rel_err_analytic": np.sqrt(analytic) / true, "max_z": float(z.max())}
            where = "every angle" if tested.all() else f"θ ≥ {thetas[tested].min():.2f} (||x + y|| ≤ 1.5)"
            checks.append((f"r = {r}: {label}'s empirical MSE within 5 SE of its analytic MSE at {where} "
                           f"(max |z| {z.max():.2f})", bool(z.max() < 5.0)))

    rows = []
    for r in radii:
        lemma = lemma34_max_rel_error(r, 128)
        bound = theorem35_bound(r, 48, 8)
        worst = {label: float(np.max(out[(r, label)]["rel_err_analytic"])) for label in METHODS}
        for label in ("FAVOR+", "trig"):
            rows.append([r, label, "max rel. error (Lemma 3.4)", lemma, worst[label],
                         float(np.max(out[(r, label)]["rel_err"]))])
            checks.append((f"r = {r}: {label}'s largest analytic relative error equals Lemma 3.4's "
                           f"√(1/2m)·W(r) = {lemma:.4g} (favor {worst[label]:.4g})",
                           abs(worst[label] - lemma) <= 1e-3 * lemma))
        rows.append([r, "HRF-angular", "max rel. error ≤ Thm 3.5 bound", bound, worst["HRF-angular"],
                     float(np.max(out[(r, "HRF-angular")]["rel_err"]))])
        rows.append([r, "HRF-Gaussian", "max rel. error", None, worst["HRF-Gaussian"],
                     float(np.max(out[(r, "HRF-Gaussian")]["rel_err"]))])
        checks.append((f"r = {r}: HRF-angular's largest relative error below Theorem 3.5's bound",
                       worst["HRF-angular"] <= bound))
        for label in ("HRF-angular", "HRF-Gaussian"):
            checks.append((f"r = {r}: {label}'s largest relative error below both FAVOR+'s and trig's",
                           worst[label] < min(worst["FAVOR+"], worst["trig"])))

    def plot(fig):
        axes = fig.subplots(2, 4, sharex=True)
        for i, r in enumerate(radii):
            for j, label in enumerate(METHODS):
                ax = axes[i, j]
                o = out[(r, label)]
                ax.fill_between(thetas, o["p5"], o["p95"], color="C0", alpha=0.25,
                                label="5th–95th percentile")
                ax.plot(thetas, o["true"], color="black", lw=1.2, label="true SM(x, y)")
                ax.axhline(0.0, color="red", ls=":", lw=0.8)
                ax.set_title(f"{label} (m = {METHODS[label][2]}), r = {r}", fontsize=9)
                ax.set_ylabel("estimate of SM(x, y)")
                if i == 1:
                    ax.set_xlabel("angle θ between x and y (rad)")
                ax2 = ax.twinx()
                ax2.plot(thetas, o["rel_err"], color="C3", marker=".", ms=3, lw=0,
                         label="relative error (empirical)")
                ax2.plot(thetas, o["rel_err_analytic"], color="C3", lw=1, label="relative error (analytic)")
                ax2.set_ylabel("relative error", color="C3")
                ax2.set_ylim(bottom=0.0)
                if i == 0 and j == 0:
                    h1, l1 = ax.get_legend_handles_labels()
                    h2, l2 = ax2.get_legend_handles_labels()
                    ax.legend(h1 + h2, l1 + l2, fontsize=6, loc="upper right")
        fig.suptitle(f"HRF Fig. 2: pointwise softmax-kernel estimates, d = {D}, {estimates} draws per angle")

    return Report(
        title="hrf-pointwise: HRF Fig. 2 (pointwise estimates over angles)",
        protocol=PROTOCOL,
        columns=["r", "estimator", "quantity", "paper", "favor (analytic)", "favor (empirical)"],
        rows=rows, checks=checks, plot=plot, figsize=(17, 7),
        notes=["The paper's Fig. 2 gives no numbers; the paper column holds its lemma and theorem values "
               "at this m.",
               "At small angles (x ≈ y, large ||x + y||) FAVOR+'s and the hybrids' empirical relative "
               "errors leave the analytic curve: a positive random feature's squared error is so "
               "heavy-tailed there that 10,000 draws misjudge its mean, mostly below it (the draws that "
               "carry most of it are rarely seen) and above it where one such draw is seen (the angles "
               "share their draws, so one draw lifts a run of neighbouring angles: FAVOR+ at r = 1.5, "
               "θ ≈ 0.6). The analytic curve is the true error; the empirical one is checked where "
               "||x + y|| ≤ 1.5."],
        figures={"thetas": thetas, "estimates": estimates,
                 "curves": {f"r={r}/{label}": v for (r, label), v in out.items()}})
