"""The input regimes of the papers' variance experiments (CRT §5.1, FAVOR# §5.1) and the per-pair
log-variance of a mechanism on them, computed with favor's analytic formulas.

normal     x, y ~ N(0, σ²I)
sphere     x, y uniform on σ·S^{d−1}
heterogen  x ~ N(0, σ²I), y ~ N(σ·1, σ²I)
mnist      random 8×8 images, pixel values in [0, 1], times σ. MNIST resized to 8×8 in the papers;
           scikit-learn's digits (8×8, grey levels 0..16, divided by 16) here: it ships with
           scikit-learn, and no machine favor is tested on can download MNIST. Its 1797 images
           give two disjoint sets of at most 898 (L = 898 where the papers use 1024).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from favor import kernels

REGIMES = ("normal", "sphere", "heterogen", "mnist")


@functools.lru_cache(maxsize=1)
def _digits():
    from sklearn.datasets import load_digits    # scikit-learn takes about a second to import: loaded on use
    return (load_digits().data / 16.0).astype(np.float32)   # [1797, 64]


def protocol(args, sigma_range):
    """(set size, samples, σ grid, rng) of the variance reproductions: L = 1024, 5 samples, 10 σ
    (--quick: 128, 2, 4), each overridable by --set_size / --samples."""
    size = args.set_size or (128 if args.quick else 1024)
    samples = args.samples or (2 if args.quick else 5)
    sigmas = np.linspace(*sigma_range, 4 if args.quick else 10)
    return size, samples, sigmas, np.random.default_rng(args.seed)


def mnist_size(size):
    """The set size the mnist regime can give: two disjoint sets of the 1797 digits."""
    return min(size, len(_digits()) // 2)


def sample(regime: str, sigma: float, size: int, d: int, rng: np.random.Generator):
    """Two sets x, y [size, d] of the regime at scale σ."""
    if regime == "normal":
        return (sigma * rng.standard_normal((size, d)), sigma * rng.standard_normal((size, d)))
    if regime == "sphere":
        u = rng.standard_normal((2, size, d))
        u /= np.linalg.norm(u, axis=-1, keepdims=True)
        return sigma * u[0], sigma * u[1]
    if regime == "heterogen":
        return (sigma * rng.standard_normal((size, d)),
                sigma * (1.0 + rng.standard_normal((size, d))))
    if regime == "mnist":
        images = _digits()
        if d != images.shape[1]:
            raise ValueError(f"the mnist regime (8×8 digits) has d = {images.shape[1]}; got d = {d}")
        # two disjoint sets: a pair of identical images has zero trig variance (log-variance −inf),
        # which MNIST's 70,000 images make rare and 1,797 digits would make common. So at most 898
        # images a set (see mnist_size).
        size = mnist_size(size)
        pick = rng.permutation(len(images))[:2 * size]
        return sigma * images[pick[:size]], sigma * images[pick[size:]]
    raise ValueError(f"unknown regime {regime!r}; valid: {', '.join(REGIMES)}")


def pair_log_variances(mech, x, y, gaussian=True, row_chunk=128, params=None):
    """log Var of one sample of `mech`'s estimator for every pair (x_i, y_j), float64 numpy
    [Lx, Ly], with the mechanism fitted on the two sets (the papers' protocol). gaussian=True: of
    the Gaussian kernel exp(−||x − y||²/2) = e^{−||x||²/2} SM(x, y) e^{−||y||²/2}, whose estimator
    is the softmax one times those factors, so its log-variance is the softmax one − ||x||² − ||y||².
    Rows go in chunks: the discrete mechanisms' second moment builds [rows, Ly, d]. params: the
    mechanism's parameters instead of its fit (e.g. another geometric p)."""
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    params = _fit_fn(mech)(x, y) if params is None else params
    fn = _log_variance_fn(mech)
    out = [np.asarray(fn(x[i:i + row_chunk], y, params), np.float64)
           for i in range(0, x.shape[0], row_chunk)]
    lv = np.concatenate(out, 0)
    if gaussian:
        xn, yn = np.asarray(x, np.float64), np.asarray(y, np.float64)
        lv = lv - np.sum(xn * xn, -1)[:, None] - np.sum(yn * yn, -1)[None, :]
    return lv


@functools.lru_cache(maxsize=None)
def _fit_fn(mech):
    return jax.jit(mech.fit)


@functools.lru_cache(maxsize=None)
def _log_variance_fn(mech):
    return jax.jit(mech.log_variance)


@functools.lru_cache(maxsize=None)
def _mechanism(name, options):
    return kernels.get(name, **dict(options))


def mechanism(name, **options):
    """kernels.get, one instance per (name, options): the jitted formulas above compile once each."""
    return _mechanism(name, tuple(sorted(options.items())))


LOG2 = math.log(2.0)
