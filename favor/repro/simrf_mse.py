"""SimRF (Simplex random features) Fig. 6 and Fig. 7: the MSE of positive random features under the
iid, orthogonal (ORF), simplex (SimRF) and simplex+ (SimRF+) couplings."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from favor.repro import regimes
from favor.repro.report import Report
from favor.repro.sampling import repeated_estimates

NAME = "simrf-mse"
SUMMARY = "SimRF Fig. 6-7: MSE ratio ORF/IID and SimRF/IID vs ||x+y||; Gram-matrix error vs M"
PROTOCOL = """\
SimRF §4.1 and §5.1. Fig. 6: the analytic MSE of the positive-RF estimate of the softmax kernel with
m = d = 64 features (Theorem 3.2 with the RF-conformities of eqs. 19, 23, 24), as the ratios
MSE_ORF / MSE_IID and MSE_SimRF / MSE_IID against v = ||x + y||; the ratio depends on the data only
through v. Monte Carlo points (x = y = (v/2)·e₁, 4000 draws each) check the curves, SimRF+ included
(it has no closed form). Fig. 7: N = 64 points x_i ~ N(0, σ²I), d = 64, σ = 0.1; the Gaussian-kernel
Gram matrix K_ij = exp(−||x_i − x_j||²/2) is estimated with M ∈ {16, ..., 1024} positive RFs, and
the error Σ_ij (K_ij − K̂_ij)² is averaged over 500 draws (mean ± one standard error of the mean, the
paper's shading); the analytic expectation (sum of the pairwise MSEs) is drawn for iid, ORF, SimRF.
"""

COUPLINGS = ("iid", "orthogonal", "simplex", "simplex+")
LABELS = {"iid": "IIDRF", "orthogonal": "ORF", "simplex": "SimRF", "simplex+": "SimRF+"}
PAPER_LIMIT = 0.0078   # SimRF §5.1: the v² prefactor of MSE_SimRF at d = 64 (MSE_IID → v²/m)


def add_arguments(parser):
    parser.add_argument("--repeats", type=int, default=None,
                        help="draws per Gram-matrix point (default 500; --quick 100)")


def analytic_mse(coupling, x, y, m):
    """Theorem 3.2's MSE of m positive RFs of SM(x_i, y_j) under a coupling, every pair [Lx, Ly],
    float64: favor's public mechanism.variance(..., coupling=...)."""
    mech = regimes.mechanism("positive")
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    return np.asarray(mech.variance(x, y, mech.fit(x, y), m, coupling=coupling), np.float64)


def on_axis(v, d):
    """x = (v/2)·e₁ for each v [len(v), d]: x = y gives ||x + y|| = v."""
    x = np.zeros((len(v), d), np.float64)
    x[:, 0] = np.asarray(v) / 2.0
    return x


def diagonal_mse(coupling, v, d, m):
    """MSE at x = y = (v/2)·e₁ for each v (the diagonal of analytic_mse)."""
    x = on_axis(v, d)
    # each point as a batch of its own [1, 1] pair: the whole [n, n] grid would evaluate the coupled
    # series n times over for the n pairs on its diagonal
    return analytic_mse(coupling, x[:, None], x[:, None], m)[:, 0, 0]


def _mc_mse(coupling, v, d, m, repeats, seed):
    """Empirical MSE of the positive-RF estimate of SM(x, x) at x = (v/2)·e₁, with its standard error."""
    mech = regimes.mechanism("positive")
    x = np.zeros((1, d), np.float32)
    x[0, 0] = v / 2.0
    x = jnp.asarray(x)
    params = mech.fit(x, x)
    est = repeated_estimates(mech, x, x, params, m, repeats, seed=seed, coupling=coupling,
                             chunk=min(repeats, 500))[:, 0, 0]
    sq = (est - np.exp(v * v / 4.0)) ** 2
    return float(sq.mean()), float(sq.std(ddof=1) / np.sqrt(len(sq)))


def _gram_errors(x, m, coupling, repeats, seed):
    mech = regimes.mechanism("positive")
    params = mech.fit(x, x)
    est = repeated_estimates(mech, x, x, params, m, repeats, seed=seed, coupling=coupling,
                             chunk=min(repeats, 100))
    xn = np.asarray(x, np.float64)
    sq = np.sum(xn * xn, -1)
    gauss = np.exp(-0.5 * sq)
    k_hat = est * gauss[None, :, None] * gauss[None, None, :]       # SM estimate → Gaussian kernel
    k = np.exp(-0.5 * (sq[:, None] + sq[None, :] - 2.0 * xn @ xn.T))
    return np.sum((k_hat - k[None]) ** 2, axis=(1, 2))


def run(args):
    quick = args.quick
    d = m = 64
    repeats = args.repeats or (100 if quick else 500)
    mc_repeats = 500 if quick else 4000
    vs = np.linspace(1e-3, 3.0, 300)
    iid = diagonal_mse("iid", vs, d, m)
    ratio = {c: diagonal_mse(c, vs, d, m) / iid for c in ("orthogonal", "simplex")}
    mc_vs = np.array([0.5, 1.0] if quick else [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5])
    mc = {c: [_mc_mse(c, float(v), d, m, mc_repeats, seed=args.seed + 17 * i)
              for i, v in enumerate(mc_vs)] for c in COUPLINGS}
    mc_iid_analytic = diagonal_mse("iid", mc_vs, d, m)

    rng = np.random.default_rng(args.seed)
    x = jnp.asarray(0.1 * rng.standard_normal((64, d)), jnp.float32)
    ms = [16, 64] if quick else [16, 32, 64, 128, 256, 512, 1024]
    gram = {c: [] for c in COUPLINGS}
    for c in COUPLINGS:
        for j, mm in enumerate(ms):
            err = _gram_errors(x, mm, c, repeats, seed=args.seed + 1000 + j)
            gram[c].append((float(err.mean()), float(err.std(ddof=1) / np.sqrt(len(err)))))
    xn = np.asarray(x, np.float64)
    sq = np.sum(xn * xn, -1)
    # the softmax-kernel MSE times e^{−||x_i||² − ||x_j||²}: the Gaussian kernel's
    gram_analytic = {c: [float(np.sum(analytic_mse(c, x, x, mm) * np.exp(-sq[:, None] - sq[None, :])))
                         for mm in ms]
                     for c in ("iid", "orthogonal", "simplex")}

    limit = float(ratio["simplex"][0])
    rows = [["SimRF/IID as v → 0 (v = 0.001)", PAPER_LIMIT, limit]]
    for v in (0.5, 1.0, 2.0, 3.0):
        i = int(np.argmin(np.abs(vs - v)))
        rows.append([f"ORF/IID, SimRF/IID at v = {v:g}", "(Fig. 6 curve)",
                     f"{ratio['orthogonal'][i]:.4f} / {ratio['simplex'][i]:.4f}"])
    for j, mm in enumerate(ms):
        rows.append([f"Gram error at M = {mm} (IID / ORF / SimRF / SimRF+), ± SE", "(Fig. 7 curve)",
                     " / ".join(f"{gram[c][j][0]:.3g} ± {gram[c][j][1]:.2g}" for c in COUPLINGS)])
    checks = [
        (f"SimRF/IID → {PAPER_LIMIT} as v → 0 (favor {limit:.4f})", abs(limit - PAPER_LIMIT) < 1e-4),
        ("analytic: SimRF < ORF < IID at every v in (0, 3]",
         bool(np.all(ratio["simplex"] < ratio["orthogonal"]) and np.all(ratio["orthogonal"] < 1.0))),
    ]
    # Monte Carlo within 5 standard errors of the analytic MSE, for the couplings that have one. Only
    # up to v = 1.5: beyond it the squared error's kurtosis grows like e^{4v²}, the sample mean of a
    # few thousand draws usually falls below the mean and the sample SE understates its spread, so
    # a z-test is not valid there (those points are plotted, not tested).
    tested = mc_vs <= 1.5
    for c in ("iid", "orthogonal", "simplex"):
        analytic = diagonal_mse(c, mc_vs, d, m)
        z = [abs(mc[c][i][0] - analytic[i]) / mc[c][i][1] for i in range(len(mc_vs)) if tested[i]]
        checks.append((f"Monte Carlo MSE of {LABELS[c]} within 5 SE of Theorem 3.2 at v ≤ 1.5 "
                       f"(max |z| {max(z):.2f})", max(z) < 5.0))
    # Fig. 7: 'SimRFs consistently outperform ORFs and IIDRFs'. Beyond 3 SE where M ≥ d; below d the
    # gaps shrink to a few per cent (the analytic expectations keep the order) and the check is that
    # no coupling's order is reversed beyond 3 SE.
    def below(a, b, j, margin=3.0):
        return gram[a][j][0] + margin * np.hypot(gram[a][j][1], gram[b][j][1]) < gram[b][j][0]
    big = [j for j, mm in enumerate(ms) if mm >= d]
    checks.append(("Gram error: SimRF below ORF below IID at every M ≥ d (beyond 3 SE)",
                   all(below("simplex", "orthogonal", j) and below("orthogonal", "iid", j) for j in big)))
    checks.append(("Gram error: no reversal of SimRF ≤ ORF ≤ IID beyond 3 SE at any M",
                   not any(below("iid", "orthogonal", j) or below("orthogonal", "simplex", j)
                           for j in range(len(ms)))))
    checks.append(("Gram error: analytic expectation SimRF < ORF < IID at every M",
                   all(gram_analytic["simplex"][j] < gram_analytic["orthogonal"][j] < gram_analytic["iid"][j]
                       for j in range(len(ms)))))
    zg = max(abs(gram[c][j][0] - gram_analytic[c][j]) / gram[c][j][1]
             for c in gram_analytic for j in range(len(ms)))
    checks.append((f"Gram error: Monte Carlo mean within 5 SE of the analytic expectation (iid, ORF, SimRF; "
                   f"max |z| {zg:.2f})", zg < 5.0))
    notes = [
        "Monte Carlo points beyond v = 1.5 are drawn but not tested: the squared error's kurtosis grows "
        "like e^{4v²}, so the mean of 4000 draws usually falls below the MSE (the IIDRF point at v = 2.5) "
        "and its sample standard error understates the spread.",
        "SimRF+ has no closed-form MSE (its directions depend on the data); its Monte Carlo points "
        "sit at or just below SimRF's, as the paper reports (SimRF+ 'slightly better').",
    ]

    def plot(fig):
        ax1, ax2 = fig.subplots(1, 2)
        for c, col in (("orthogonal", "C1"), ("simplex", "C2")):
            ax1.plot(vs, ratio[c], color=col, label=f"{LABELS[c]} / IIDRF (analytic)")
        for c, col, mk in (("iid", "C0", "s"), ("orthogonal", "C1", "o"), ("simplex", "C2", "^"),
                           ("simplex+", "C3", "v")):
            r = np.array([p[0] for p in mc[c]]) / mc_iid_analytic
            e = np.array([p[1] for p in mc[c]]) / mc_iid_analytic
            ax1.errorbar(mc_vs, r, yerr=e, fmt=mk, color=col, ms=4, capsize=2,
                         label=f"{LABELS[c]} / IIDRF (Monte Carlo, ±1 SE)")
        ax1.axhline(PAPER_LIMIT, color="grey", ls=":", label=f"paper: SimRF limit {PAPER_LIMIT} at v → 0")
        ax1.set_xlabel("v = ||x + y||")
        ax1.set_ylabel("MSE ratio to IIDRF (m = d = 64)")
        ax1.set_title("Fig. 6: MSE of positive RFs, relative to IID")
        ax1.legend(fontsize=7)
        ax1.grid(alpha=0.3)
        for i, c in enumerate(COUPLINGS):
            mean = np.array([g[0] for g in gram[c]])
            se = np.array([g[1] for g in gram[c]])
            ax2.plot(ms, mean, marker="o", ms=3, color=f"C{i}", label=f"{LABELS[c]} (mean of {repeats})")
            ax2.fill_between(ms, mean - se, mean + se, color=f"C{i}", alpha=0.2)
            if c in gram_analytic:
                ax2.plot(ms, gram_analytic[c], color=f"C{i}", ls=":", lw=1)
        ax2.plot([], [], color="black", ls=":", lw=1, label="analytic expectation")
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("M (number of random features)")
        ax2.set_ylabel(r"Frobenius error $\sum_{ij}(K_{ij} - \hat{K}_{ij})^2$")
        ax2.set_title("Fig. 7: Gram-matrix error, N = 64, d = 64, σ = 0.1")
        ax2.legend(fontsize=7)
        ax2.grid(alpha=0.3, which="both")

    return Report(
        title="simrf-mse: SimRF Fig. 6 (MSE ratios) and Fig. 7 (Gram-matrix error)",
        protocol=PROTOCOL, columns=["quantity", "paper", "favor"], rows=rows, checks=checks,
        notes=notes, plot=plot, figsize=(13, 4.8),
        figures={"v": vs, "ratio": ratio, "mc_v": mc_vs, "monte_carlo": mc, "ms": ms, "gram": gram,
                 "gram_analytic": gram_analytic, "repeats": repeats})
