"""Set statistics the data-dependent mechanisms are fitted from, with padding masks.

Everything here is O(L·d) or O(L·d²): no statistic ever forms the Lx × Ly pair matrix.
"""

from __future__ import annotations

import jax.numpy as jnp


def row_weights(u, mask):
    """Weights [..., L] that average over valid rows (all rows when mask is None).

    A set with no valid row gets zero weights; its statistics are then zero, which every
    closed form below maps to the data-independent mechanism (A = 0, identity transforms).
    """
    if mask is None:
        w = jnp.ones(u.shape[:-1], jnp.float32)
    else:
        w = jnp.asarray(mask, jnp.float32)
    return w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1.0)


def mean(u, w):
    """Σ_i w_i u_i: [..., d]."""
    return jnp.einsum("...l,...ld->...d", w, u)


def second_moment(u, w):
    """Σ_i w_i u_i u_iᵀ: [..., d, d]."""
    return jnp.einsum("...l,...ld,...le->...de", w, u, u)


def mean_sq_norm(u, w):
    return jnp.einsum("...l,...l->...", w, jnp.sum(u * u, axis=-1))


def mean_pair_sq_norm(x, wx, y, wy):
    """mean_{i,j} ||x_i + y_j||² in O(L·d) (CRT eq. 8)."""
    return mean_sq_norm(x, wx) + 2.0 * jnp.sum(mean(x, wx) * mean(y, wy), -1) + mean_sq_norm(y, wy)


def rho_star(v, d):
    """CRT Theorem 3.3's ρ*(v, d), written as 2d / (√((2v+d)² + 8dv) + 2v + d).

    Algebraically equal to (√((2v+d)²+8dv) − 2v − d) / (4v) but with no 0/0 at v = 0,
    where ρ* = 1 (A* = 0, positive RFs).
    """
    v = jnp.maximum(v, 0.0)
    return 2.0 * d / (jnp.sqrt((2.0 * v + d) ** 2 + 8.0 * d * v) + 2.0 * v + d)


def optimal_a(v, d):
    """A* = (1 − 1/ρ*)/8 ≤ 0: the OPRF/GERF parameter minimising the log-variance objective."""
    return (1.0 - 1.0 / rho_star(v, d)) / 8.0


def sym_sqrt_and_inv(m, eps=1e-6):
    """M^(1/2) and M^(-1/2) of a symmetric PSD matrix via eigh, eigenvalues floored at eps·tr/d.

    The floor only matters for rank-deficient statistics (fewer valid rows than d); any SPD
    transform keeps the DERF features unbiased, so it costs optimality, never correctness.
    """
    d = m.shape[-1]
    lam, u = jnp.linalg.eigh(m)
    floor = eps * jnp.maximum(jnp.trace(m, axis1=-2, axis2=-1) / d, 1e-12)
    lam = jnp.maximum(lam, floor[..., None])
    root = jnp.sqrt(lam)
    ut = jnp.swapaxes(u, -1, -2)
    return (u * root[..., None, :]) @ ut, (u / root[..., None, :]) @ ut
