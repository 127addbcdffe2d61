"""Non-parametric classification by kernel regression with a random-feature Gaussian kernel (CRT §5.2,
SimRF §5.3): the data, the split, the σ search and the accuracy of one method over feature seeds.

r*(o) = Σ_i K(σo, σo_i) r_i / Σ_i K(σo, σo_i), K(x, y) = exp(−||x − y||²/2) = e^{−||x||²/2} SM(x, y)
e^{−||y||²/2}; with features, K̂ = e^{−||x||²/2} φ_q(x)ᵀφ_k(y) e^{−||y||²/2}. The query's own factor is
common to every class and to the denominator, so it cancels in r*. Sums run in log space: each
feature column is scaled by its largest training value and each query row by its largest term
(at σ = 100 the kernel values are e^{−10⁴} and below).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import logsumexp

from favor import kernels

SKLEARN_SETS = ("iris", "wine", "breast_cancer", "digits")
SHIFT_EPS = 1e-8   # CRT §9.10.2: queries are clamped to ≥ c + ε for the shifted (+) variants (a
                   # method's shift_eps option, when it has one, takes its place)


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    mechanism: str | None          # None: the exact kernel
    num_features: int = 0
    coupling: str = "iid"
    options: tuple = ()            # (name, value) pairs for kernels.get


@dataclasses.dataclass
class Split:
    name: str
    train: tuple
    val: tuple
    test: tuple
    classes: int


def load(spec: str):
    """(x [N, d] float32, y [N] int, name) from 'sklearn:<name>', a .npz with x and y, or a CSV whose
    last column is the label."""
    if spec.startswith("sklearn:"):
        name = spec.split(":", 1)[1]
        import sklearn.datasets as skd    # scikit-learn takes about a second to import: loaded on use
        if name not in SKLEARN_SETS:
            raise ValueError(f"unknown scikit-learn set {name!r}; valid: "
                             + ", ".join(f"sklearn:{n}" for n in SKLEARN_SETS))
        bunch = getattr(skd, f"load_{name}")()
        return bunch.data.astype(np.float32), bunch.target.astype(np.int64), name
    if not os.path.exists(spec):
        raise FileNotFoundError(f"--data {spec!r}: no such file; give an .npz (arrays x, y), a CSV "
                                f"(last column the label) or sklearn:<{'|'.join(SKLEARN_SETS)}>")
    name = os.path.splitext(os.path.basename(spec))[0]
    if spec.endswith(".npz"):
        with np.load(spec) as f:
            missing = {"x", "y"} - set(f.files)
            if missing:
                raise ValueError(f"--data {spec!r}: the .npz needs arrays x [N, d] and y [N]; "
                                 f"missing {sorted(missing)} (has {sorted(f.files)})")
            x, y = np.asarray(f["x"], np.float32), np.asarray(f["y"])
    else:
        try:
            table = np.loadtxt(spec, delimiter=",", dtype=np.float64, ndmin=2)
        except ValueError as e:
            raise ValueError(f"--data {spec!r}: a CSV must be numbers only, comma-separated, one row per "
                             "example: the features, then an integer class label in the last column; no "
                             f"header line, no text labels (numpy: {e})") from None
        if table.shape[1] < 2:
            raise ValueError(f"--data {spec!r}: a CSV needs at least two columns (features, then the "
                             f"label); got {table.shape[1]}")
        x, y = table[:, :-1].astype(np.float32), table[:, -1]
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"--data {spec!r}: x must be [N, d] and y [N]; got {x.shape} and {y.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"--data {spec!r}: x has non-finite values")
    frac = ~np.isclose(y, np.round(y))
    if np.any(frac):
        raise ValueError(f"--data {spec!r}: labels (y, or a CSV's last column) must be integer class "
                         f"labels; row {int(np.argmax(frac))} has {y[frac][0]!r}")
    _, y = np.unique(np.round(y).astype(np.int64), return_inverse=True)
    return x, y, name


def split(x, y, name, seed):
    """90 / 5 / 5 random split, fixed by the seed; features z-scored with the training split's mean
    and sd (decision: the paper's UCI sets have comparable column ranges, scikit-learn's
    breast_cancer spans four orders of magnitude between columns, and a raw scale would let one
    column decide every kernel value at any σ)."""
    n = len(x)
    perm = np.random.default_rng(seed).permutation(n)
    n_val = n_test = max(1, int(round(0.05 * n)))
    tr, va, te = perm[:n - n_val - n_test], perm[n - n_val - n_test:n - n_test], perm[n - n_test:]
    mu, sd = x[tr].mean(0), x[tr].std(0)
    sd = np.where(sd > 0, sd, 1.0)
    z = ((x - mu) / sd).astype(np.float32)
    return Split(name, (z[tr], y[tr]), (z[va], y[va]), (z[te], y[te]), int(y.max()) + 1)


def _log_abs_sign(parts):
    """log|f| and sign f [L, F] from a feature map's log-space form (base.py's two forms)."""
    log_part, mult = parts
    if mult is None:
        return log_part, jnp.ones_like(log_part)
    if log_part.shape[-1] == 1 and mult.shape[-1] != 1:      # row log-scale, bounded values
        return log_part + jnp.log(jnp.abs(mult)), jnp.sign(mult)
    return log_part, mult


def _predict(lq, sq, lk, sk, onehot):
    """argmax_c of r*: [Q] class indices. lk already carries the keys' e^{−||σo_i||²/2}."""
    col = jax.lax.stop_gradient(jnp.max(lk, 0))
    col = jnp.where(jnp.isfinite(col), col, 0.0)
    s = onehot.T @ (sk * jnp.exp(lk - col))                   # [C, F]
    row = lq + col
    row_max = jnp.max(jnp.where(jnp.isfinite(row), row, -jnp.inf), -1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    num = (sq * jnp.exp(row - row_max)) @ s.T                 # [Q, C], a common positive factor out
    r = num / jnp.sum(num, -1, keepdims=True)                 # the denominator may be negative
    return jnp.argmax(r, -1)


@functools.lru_cache(maxsize=None)
def _accuracy_fn(method: Method):
    mech = kernels.get(method.mechanism, **dict(method.options))
    shifted = method.mechanism in ("poisson+", "geometric+")
    eps = float(dict(method.options).get("shift_eps", SHIFT_EPS))

    @jax.jit
    def accuracies(keys, params, xq, yq, xk, onehot):
        if shifted:   # no test data in c: it comes from the training split; queries are clamped
            xq = jnp.maximum(xq, params.shift + eps)

        def one(key):
            w = mech.draw(key, method.num_features, params, method.coupling)
            lq, sq = _log_abs_sign(mech.query_log_features(xq, w, params))
            lk, sk = _log_abs_sign(mech.key_log_features(xk, w, params))
            lk = lk - 0.5 * jnp.sum(xk * xk, -1, keepdims=True)
            return jnp.mean(_predict(lq, sq, lk, sk, onehot) == yq)
        return jax.vmap(one)(keys)
    return mech, accuracies


def exact_accuracy(xq, yq, xk, yk, classes):
    """The exact kernel's accuracy, float64 numpy (the ceiling every estimate tends to)."""
    xq, xk = np.asarray(xq, np.float64), np.asarray(xk, np.float64)
    logk = -0.5 * (np.sum(xq ** 2, -1)[:, None] + np.sum(xk ** 2, -1)[None, :] - 2.0 * xq @ xk.T)
    scores = np.stack([logsumexp(np.where(yk[None, :] == c, logk, -np.inf), axis=1)
                       for c in range(classes)], 1)
    return float(np.mean(np.argmax(scores, 1) == yq))


def accuracies(method: Method, data: Split, sigma: float, part: str, seeds: int, seed: int):
    """Accuracy on `part` ('val' or 'test') for each of `seeds` feature draws: [seeds] numpy."""
    xk, yk = data.train
    xq, yq = getattr(data, part)
    if method.mechanism is None:
        return np.array([exact_accuracy(sigma * xq, yq, sigma * xk, yk, data.classes)])
    mech, fn = _accuracy_fn(method)
    xk_s, xq_s = jnp.asarray(sigma * xk), jnp.asarray(sigma * xq)
    params = mech.fit(xk_s, xk_s)      # on the training split only: no validation or test data leak
    keys = jax.random.split(jax.random.PRNGKey(seed), seeds)
    onehot = jax.nn.one_hot(yk, data.classes, dtype=jnp.float32)
    return np.asarray(fn(keys, params, xq_s, jnp.asarray(yq), xk_s, onehot), np.float64)


def evaluate(method: Method, data: Split, sigmas, seeds: int, seed: int):
    """σ by the mean validation accuracy over `seeds` draws (ties: the smaller σ), then the test
    accuracy over `seeds` fresh draws at that σ: (mean, sd, σ, validation means)."""
    val = [float(np.mean(accuracies(method, data, float(s), "val", seeds, seed))) for s in sigmas]
    best = int(np.argmax(val))
    test = accuracies(method, data, float(sigmas[best]), "test", seeds, seed + 1)
    return float(test.mean()), float(test.std()), float(sigmas[best]), val


def budget_features(name: str, budget: int, options=()) -> int:
    """The number of random features (the `num_features` argument) whose feature width is closest to
    `budget` real numbers without exceeding it (trig: 64 frequencies for 128; HRF: its m)."""
    mech = kernels.get(name, **dict(options))
    best = 1
    for m in range(1, budget + 1):
        if mech.feature_dim(m) <= budget:
            best = m
    return best


def plot_accuracies(ax, results, labels, tick, title):
    """Grouped bars: test accuracy (mean ± sd over seeds) per data set and method, the exact kernel
    in black. results[data set][label] = {"mean", "sd"}; tick(data set) labels each group."""
    # plotting loads matplotlib only when a plot is drawn
    import matplotlib
    colours = matplotlib.colormaps["tab20"]      # the default cycle repeats after 10 methods
    dnames = list(results)
    width = 0.8 / len(labels)
    for j, lab in enumerate(labels):
        ax.bar(np.arange(len(dnames)) + j * width, [100 * results[d][lab]["mean"] for d in dnames], width,
               yerr=[100 * results[d][lab]["sd"] for d in dnames], capsize=2, label=lab,
               color="black" if lab == "exact kernel" else colours(j % 20))
    ax.set_xticks(np.arange(len(dnames)) + 0.4 - width / 2)
    ax.set_xticklabels([tick(d) for d in dnames])
    ax.set_ylabel("test accuracy (%), mean ± sd over feature seeds")
    lo = min(100 * results[d][lab]["mean"] for d in dnames for lab in labels)
    ax.set_ylim(max(0.0, lo - 10), 101)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              title="method", title_fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title)
