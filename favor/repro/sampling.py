"""Monte Carlo over independent draws of a mechanism (the reproductions' empirical points; the tests'
statistical checks use it too)."""

from __future__ import annotations

import functools

import jax
import numpy as np


@functools.lru_cache(maxsize=64)
def _many(mech, num_features, coupling):
    """One jitted program per (mechanism, M, coupling): later calls with other inputs of the same
    shapes reuse its compilation."""
    @jax.jit
    def many(keys, x, y, params):
        def one(key):
            w = mech.draw(key, num_features, params, coupling)
            return mech.estimate(x, y, w, params)
        return jax.vmap(one)(keys)
    return many


def repeated_estimates(mech, x, y, params, num_features, repeats, seed=0, coupling="iid", chunk=1000):
    """[R, Lx, Ly] estimates of exp(x yᵀ) from R independent draws, as float64 numpy (R rounded up
    to whole chunks)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), -(-repeats // chunk) * chunk)
    many = _many(mech, num_features, coupling)
    # A Python loop over jitted chunks: lax.map over batched QR hung XLA:CPU here (jax 0.10.2).
    return np.concatenate([np.asarray(many(keys[i:i + chunk], x, y, params), np.float64)
                           for i in range(0, len(keys), chunk)])
