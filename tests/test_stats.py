"""favor.kernels.stats helpers that the fits build on: eigenvector signs fixed, so an estimate does not
depend on which eigensolver (eager or jitted, LAPACK or XLA's) computed the fit."""

import jax
import jax.numpy as jnp
import numpy as np

from favor.kernels import stats


def test_canonical_signs_undo_any_flip_and_keep_the_eigenvectors():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 6))
    w, u = np.linalg.eigh(a @ a.T + np.diag(np.arange(6.0)))          # distinct eigenvalues
    flips = np.array([1, -1, -1, 1, -1, 1], np.float32)
    c1 = np.asarray(stats.canonical_signs(jnp.asarray(u, jnp.float32)))
    c2 = np.asarray(stats.canonical_signs(jnp.asarray(u * flips, jnp.float32)))
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_allclose(np.abs(c1), np.abs(u), atol=1e-7)                   # each column ± itself
    big = np.abs(c1).argmax(0)
    assert np.all(c1[big, np.arange(6)] > 0)
    # a derivative through it is the eigenvector's own, signed (the flip is piecewise constant)
    g = jax.grad(lambda m: stats.canonical_signs(stats.eigh(m)[1])[:, -1].sum())(jnp.asarray(a @ a.T, jnp.float32))
    assert np.all(np.isfinite(np.asarray(g)))
