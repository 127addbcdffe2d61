"""Set statistics the data-dependent mechanisms are fitted from, with padding masks.

Everything here is O(L·d) or O(L·d²): no statistic ever forms the Lx × Ly pair matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from favor.kernels.base import pytree_dataclass


@pytree_dataclass
class Moments:
    """Sufficient statistics of the exponential mechanisms' fits: weighted means and second moments
    of both sets (every fit is a closed form of these), and the valid-row counts."""
    mean_x: jax.Array     # [..., d]
    mean_y: jax.Array     # [..., d]
    second_x: jax.Array   # [..., d, d]  E[x xᵀ] (only its diagonal, off-diagonal 0, from moments(full=False))
    second_y: jax.Array   # [..., d, d]
    count: jax.Array      # [...] valid rows seen (the smaller of the two sets)

    def transformed(self, tq, tk):
        """Moments of x' = x·T_q and y' = y·T_k."""
        tqt, tkt = jnp.swapaxes(tq, -1, -2), jnp.swapaxes(tk, -1, -2)
        return Moments(mean_x=jnp.einsum("...d,...de->...e", self.mean_x, tq),
                       mean_y=jnp.einsum("...d,...de->...e", self.mean_y, tk),
                       second_x=tqt @ self.second_x @ tq, second_y=tkt @ self.second_y @ tk,
                       count=self.count)

    def mean_pair_sq_norm(self):
        """mean_{i,j} ||x_i + y_j||² (CRT eq. 8) from the moments."""
        tr = lambda m: jnp.trace(m, axis1=-2, axis2=-1)
        return tr(self.second_x) + 2.0 * jnp.sum(self.mean_x * self.mean_y, -1) + tr(self.second_y)


def moments(x, y, x_mask=None, y_mask=None, full=True):
    """Moments of the valid rows of x [..., Lx, d] and y [..., Ly, d]. full=False: the second moments'
    diagonals only (as diagonal matrices), O(L·d) instead of O(L·d²): all that fits with an identity or
    diagonal transform read (OPRF's trace statistic, SADERF's per-coordinate scales); at L = 8192, d = 64
    the full second moments cost a fifth of FAVOR+'s whole forward pass on a CPU."""
    wx, wy = row_weights(x, x_mask), row_weights(y, y_mask)
    count = jnp.minimum(valid_count(x, x_mask), valid_count(y, y_mask))
    mean_x, mean_y = mean(x, wx), mean(y, wy)
    second = second_moment if full else diagonal_second_moment
    second_x, second_y = second(x, wx), second(y, wy)
    bs = jnp.broadcast_shapes(mean_x.shape[:-1], mean_y.shape[:-1])
    d = x.shape[-1]
    b = lambda a, tail: jnp.broadcast_to(a, (*bs, *tail))
    return Moments(mean_x=b(mean_x, (d,)), mean_y=b(mean_y, (d,)), second_x=b(second_x, (d, d)),
                   second_y=b(second_y, (d, d)), count=b(count, ()))


def layer_moments(x, y, x_mask=None, y_mask=None, full=True):
    """`moments` per batch and head of an attention layer's scaled queries x [B, Lx, H, d] and keys
    y [B, Ly, H, d] in the layer's own layout (rows along axis 1), masks [B, L]: the same statistics as
    `moments` of the sets [B, H, L, d], computed as plain sums over axis 1. Why: XLA:CPU reduces this
    layout several times faster than the transposed one, and a weighted sum (a broadcast product inside
    the reduction) or several dots sharing a producer are slower still (BENCHMARKS.md,
    design-measurements)."""
    def side(u, mask):
        u = u.astype(jnp.float32)
        if mask is None:
            n = jnp.full((u.shape[0], 1, 1), float(u.shape[1]), jnp.float32)
        else:
            valid = jnp.asarray(mask, bool)
            u = jnp.where(valid[:, :, None, None], u, 0.0)           # padded rows add nothing
            n = jnp.sum(valid, axis=1).astype(jnp.float32)[:, None, None]
        inv = 1.0 / jnp.maximum(n, 1.0)                              # no valid row: zero statistics
        mean_u = jnp.sum(u, axis=1) * inv                            # [B, H, d]
        if full:
            # contracting the rows of [B, H, L, d] with itself as one dot_general: faster than ut.T @ ut
            # or a contraction over axis 1 of the [B, L, H, d] layout (BENCHMARKS.md, design-measurements)
            ut = jnp.swapaxes(u, 1, 2)
            second = jnp.einsum("bhld,bhle->bhde", ut, ut) * inv[..., None]
        else:
            second = (jnp.sum(u * u, axis=1) * inv)[..., :, None] * jnp.eye(u.shape[-1], dtype=jnp.float32)
        return mean_u, second, n[:, :, 0]

    mean_x, second_x, nx = side(x, x_mask)
    mean_y, second_y, ny = side(y, y_mask)
    count = jnp.broadcast_to(jnp.minimum(nx, ny), mean_x.shape[:-1])
    return Moments(mean_x=mean_x, mean_y=mean_y, second_x=second_x, second_y=second_y, count=count)


def valid_count(u, mask):
    if mask is None:
        return jnp.full(u.shape[:-2], float(u.shape[-2]), jnp.float32)
    return jnp.sum(jnp.asarray(mask, jnp.float32), axis=-1)


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


def diagonal_second_moment(u, w):
    """diag(Σ_i w_i u_i u_iᵀ) as a diagonal matrix [..., d, d]."""
    diag = mean(u * u, w)
    return diag[..., :, None] * jnp.eye(u.shape[-1], dtype=diag.dtype)


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


@jax.custom_jvp
def eigh(m):
    """jnp.linalg.eigh with a derivative that stays finite on degenerate spectra.

    The eigenvector derivative has 1/(λ_i − λ_j), infinite where eigenvalues coincide (fewer tokens
    than dimensions give many zero eigenvalues), and jnp's rule then puts NaN into every gradient
    (fit_gradients=True). Here 1/Δ becomes Δ/(Δ² + ε²) with ε = 1e-6 of the spectrum's scale:
    unchanged for separated eigenvalues; inside a degenerate subspace the basis is arbitrary and any
    basis gives a valid (unbiased) estimator, so rotating it is not a direction the gradient needs;
    and for matrix functions U g(Λ) Uᵀ the terms it drops are (g(λ_i) − g(λ_j))·(...) = 0 there.
    """
    return jnp.linalg.eigh(m)


@eigh.defjvp
def _eigh_jvp(primals, tangents):
    (m,), (dm,) = primals, tangents
    out = eigh(m)
    w, v = out
    dm = 0.5 * (dm + jnp.swapaxes(dm, -1, -2))
    vt = jnp.swapaxes(v, -1, -2)
    inner = vt @ dm @ v
    dw = jnp.diagonal(inner, axis1=-2, axis2=-1)
    gap = w[..., None, :] - w[..., :, None]                       # [j, i] = λ_i − λ_j
    # floored where ε² stays a normal float32 (a zero spectrum, e.g. an all-padding example, must not
    # give 0/0)
    eps = jnp.maximum(1e-6 * jnp.max(jnp.abs(w), axis=-1, keepdims=True)[..., None], 1e-18)
    inv_gap = gap / (gap * gap + eps * eps)                       # 0 on the diagonal
    # primal and tangent in eigh's own result type (a named tuple): differentiated after being staged
    # out (the gradient of a jitted function, a scan, a remat), custom_jvp checks that the rule's primal
    # has the function's structure, and a plain tuple fails that check
    return out, type(out)(dw, v @ (inv_gap * inner))


def canonical_signs(u):
    """Eigenvectors (columns of `u`) each flipped so its largest-magnitude entry is positive.

    An eigenvector's sign is arbitrary and eigensolvers choose differently (LAPACK and XLA's own, a jit
    and an eager call of the same model): where the eigenvectors rotate the data that random features
    then project (SDERF's T = U), a flip is a different draw. Both draws are valid, but the estimate would
    change with the backend; with fixed signs it does not (for distinct eigenvalues). The flip is a
    constant for the derivative (stop_gradient), which is exact: the sign is piecewise constant."""
    idx = jnp.argmax(jnp.abs(u), axis=-2, keepdims=True)
    sign = jnp.sign(jnp.take_along_axis(u, idx, axis=-2))
    return u * jax.lax.stop_gradient(jnp.where(sign == 0, 1.0, sign).astype(u.dtype))


def sym_sqrt_and_inv(m, eps=1e-6):
    """M^(1/2) and M^(-1/2) of a symmetric PSD matrix via eigh, eigenvalues floored at eps·tr/d.

    The floor only matters for rank-deficient statistics (fewer valid rows than d); any SPD
    transform keeps the DERF features unbiased, so it costs optimality, never correctness.
    """
    d = m.shape[-1]
    lam, u = eigh(m)
    floor = eps * jnp.maximum(jnp.trace(m, axis1=-2, axis2=-1) / d, 1e-12)
    lam = jnp.maximum(lam, floor[..., None])
    root = jnp.sqrt(lam)
    ut = jnp.swapaxes(u, -1, -2)
    return (u * root[..., None, :]) @ ut, (u / root[..., None, :]) @ ut
