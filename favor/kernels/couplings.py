"""Gaussian projections ω_1..ω_M ~ N(0, I_d) marginally, coupled in blocks of d (SimRF paper).

    kernels.draw(key, num_features, dim, coupling) -> Projections(omega [M, d], log_weights [M])

Couplings (registry keys are what users type):
- "iid":         independent rows.
- "orthogonal":  ORF blocks diag(norms)·R with R Haar-orthogonal (QR of a Gaussian matrix with the
                 sign of diag(R) folded back in, without which Q is not Haar) and norms ~ χ_d.
- "simplex":     SimRF blocks W = D·S·R: unit simplex directions S (pairwise angle arccos(−1/(d−1))),
                 rotated by a Haar R, scaled by D = diag(χ_d norms).
- "simplex+":    SimRF+: the norm-dependent geometry reached by the iteration
                 w_i ← −w_i Σ_{j≠i} w_j / ||Σ_{j≠i} w_j|| from the simplex start, then rotated by R.
Blocks are independent; M > d uses ⌈M/d⌉ blocks and keeps the first M rows. Each row is marginally
N(0, I_d) under every coupling (a Haar rotation of any fixed direction is uniform, and the norm is
χ_d independent of it), so every estimator stays unbiased.

The conformity functions give Theorem 3.2's closed-form MSE of positive RFs under ORF and SimRF
(SimRF paper eqs. 11, 19, 23, 24), evaluated in float64 on the host.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

from favor.kernels.base import pytree_dataclass

COUPLINGS = ("iid", "orthogonal", "simplex", "simplex+")
SIMPLEX_PLUS_PASSES = 4   # passes of the SimRF+ iteration; it converges in a few from the simplex start


@pytree_dataclass
class Projections:
    """Gaussian projections and per-row log importance weights (zero unless importance-sampled)."""
    omega: jax.Array        # [..., M, d]
    log_weights: jax.Array  # [..., M]


def check_coupling(coupling):
    if coupling not in COUPLINGS:
        raise ValueError(f"unknown coupling {coupling!r}; valid couplings: {', '.join(COUPLINGS)}")
    return coupling


def householder_qr(a):
    """Q and diag(R) of a = QR for a square [d, d] matrix, by Householder reflections in plain jnp.

    Not jnp.linalg.qr: jaxlib 0.10's batched LAPACK kernels block on the intra-op thread pool, and
    two independent batched QR calls in one program (two draws, two layers) deadlock XLA:CPU on a
    2-core machine. Reflections are O(d³) per block, the same order as LAPACK's.
    """
    d = a.shape[-1]
    idx = jnp.arange(d)

    def step(k, carry):
        r, q = carry
        x = jnp.where(idx >= k, r[:, k], 0.0)
        xk = r[k, k]
        alpha = -jnp.where(xk >= 0, 1.0, -1.0) * jnp.linalg.norm(x)
        v = x - alpha * (idx == k)
        v = v / jnp.maximum(jnp.linalg.norm(v), jnp.finfo(a.dtype).tiny)
        r = r - 2.0 * v[:, None] * (v @ r)[None, :]
        q = q - 2.0 * (q @ v)[:, None] * v[None, :]
        return r, q

    r, q = jax.lax.fori_loop(0, d, step, (a, jnp.eye(d, dtype=a.dtype)))
    return q, jnp.diagonal(r)


def haar_from_gaussian(g):
    """A Haar-distributed d×d orthogonal matrix from a standard Gaussian [d, d] one: its QR's Q with the
    sign of diag(R) folded back in."""
    q, r_diag = householder_qr(g)
    # Without this, Q's column signs follow the factorisation's convention instead of being uniform.
    return q * jnp.where(r_diag >= 0, 1.0, -1.0)[None, :]


def simplex_directions(d, dtype=jnp.float32):
    """Rows s_1..s_d: unit vectors with pairwise inner product −1/(d−1) (SimRF eq. 9)."""
    ones = np.concatenate([np.ones(d - 1), [0.0]])
    s = math.sqrt(d / (d - 1)) * np.eye(d) - (math.sqrt(d) + 1) / (d - 1) ** 1.5 * ones[None, :]
    s[d - 1] = ones / math.sqrt(d - 1)
    return jnp.asarray(s, dtype)


def simplex_plus(w, passes=SIMPLEX_PLUS_PASSES):
    """SimRF+ iteration (eq. 17): each row turned to point away from the sum of the others."""
    norms = jnp.linalg.norm(w, axis=-1)

    def update(w, i):
        others = jnp.sum(w, axis=0) - w[i]
        new = -norms[i] * others / jnp.maximum(jnp.linalg.norm(others), 1e-30)
        return w.at[i].set(new), None

    idx = jnp.tile(jnp.arange(w.shape[0]), passes)
    w, _ = jax.lax.scan(update, w, idx)
    return w


def _block(g, coupling):
    """One coupled block of d rows from a standard Gaussian [2d, d]: the first d rows give the Haar
    rotation, the norms of the last d the rows' χ_d lengths (independent of the rotation, as they must be)."""
    d = g.shape[-1]
    rot, norms = haar_from_gaussian(g[:d]), jnp.linalg.norm(g[d:], axis=-1)
    if coupling == "orthogonal":
        return norms[:, None] * rot
    w = norms[:, None] * simplex_directions(d, g.dtype)
    if coupling == "simplex+":
        w = simplex_plus(w)
    return w @ rot


def _check_sizes(sizes, dim, coupling):
    check_coupling(coupling)
    for m in sizes:
        if not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"num_features must be a positive integer; got {m!r}")
    if not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ValueError(f"dim must be a positive integer; got {dim!r}")
    if coupling.startswith("simplex") and dim < 2:
        raise ValueError(f"coupling {coupling!r} needs dim ≥ 2; got dim={dim}")


def projection_groups(key, sizes, dim, coupling="iid", dtype=jnp.float32):
    """Independent groups of [M_i, d] projections, each marginally N(0, I_d) under the coupling, from one
    Gaussian sample: group i takes its own ⌈M_i/d⌉ blocks (blocks are independent, so groups are).

    One sample of every block's [2d, d] Gaussian, not a key split per block and per part: each
    jax.random call is a threefry loop of its own in the program: with a key per block and per part a
    coupled draw's program is nearly twice as large (HRF's five times), and every program that draws
    compiles more slowly (BENCHMARKS design-measurements)."""
    sizes = tuple(sizes)
    _check_sizes(sizes, dim, coupling)
    if coupling == "iid":
        z = jax.random.normal(key, (sum(sizes), dim), dtype)
        return [z[s - m:s] for m, s in zip(sizes, np.cumsum(sizes))]
    counts = [-(-m // dim) for m in sizes]
    g = jax.random.normal(key, (sum(counts), 2 * dim, dim), dtype)
    w = jax.vmap(lambda gb: _block(gb, coupling))(g)
    ends = np.cumsum(counts)
    return [w[e - c:e].reshape(c * dim, dim)[:m] for m, c, e in zip(sizes, counts, ends)]


def gaussian_projections(key, num_features, dim, coupling="iid", dtype=jnp.float32):
    """[M, d] projections, marginally N(0, I_d), under the coupling."""
    return projection_groups(key, (num_features,), dim, coupling, dtype)[0]


def draw_groups(key, sizes, dim, coupling="iid", dtype=jnp.float32) -> list[Projections]:
    """Independent draws of sizes M_1, M_2, … (projection_groups) as Projections (log_weights zeros)."""
    return [Projections(omega=w, log_weights=jnp.zeros((w.shape[0],), dtype))
            for w in projection_groups(key, sizes, dim, coupling, dtype)]


def draw(key, num_features, dim, coupling="iid", dtype=jnp.float32) -> Projections:
    """Gaussian projections under a coupling: .omega [M, d], .log_weights [M] (zeros)."""
    return draw_groups(key, (num_features,), dim, coupling, dtype)[0]


# ---- Theorem 3.2 of the SimRF paper: MSE of positive RFs under couplings ------------------------

def conformity(v, d, coupling):
    """RF-conformity ρ(x, y) of one pair of coupled rows, as a function of v = ||x + y||.

    iid: e^{v²} (eq. 19); orthogonal: eq. 23; simplex: eq. 24. Series summed in float64 far
    past their largest term (the k-th term peaks near k ≈ v²/2).
    """
    v = np.asarray(v, np.float64)
    v2 = (v * v).ravel()
    if coupling == "iid":
        return np.exp(v2).reshape(v.shape)
    if coupling not in ("orthogonal", "simplex"):
        raise ValueError(f"closed-form conformity exists for iid, orthogonal and simplex; got {coupling!r}")
    kmax = int(80 + 3 * float(np.max(v2, initial=0.0)) + 4 * math.sqrt(d))
    k = np.arange(kmax, dtype=np.float64)
    logv2 = np.log(np.maximum(v2, 1e-300))
    # Γ(k+d)/Γ(k+d/2) · v^{2k} / (2^k k!), shared by eqs. 23 and 24
    log_base = (special.gammaln(k + d) - special.gammaln(k + d / 2) - k * math.log(2.0)
                - special.gammaln(k + 1))[:, None] + k[:, None] * logv2[None, :]
    if coupling == "orthogonal":
        out = np.exp(log_base + special.gammaln(d / 2) - special.gammaln(d)).sum(axis=0)
    else:
        # eq. 24's inner sum times k!: Σ_p C(k,p) (−1/(d−1))^p Γ((d+p)/2)/Γ((d+p+1)/2) > 0
        p = k
        kk, pp = np.meshgrid(k, p, indexing="ij")
        valid = pp <= kk
        log_binom = np.where(valid, special.gammaln(kk + 1) - special.gammaln(pp + 1)
                             - special.gammaln(np.maximum(kk - pp, 0) + 1), -np.inf)
        log_h = special.gammaln((d + p) / 2) - special.gammaln((d + p + 1) / 2)
        signs = np.where(pp % 2 == 1, -1.0, 1.0)
        inner = np.sum(np.where(valid, signs * np.exp(log_binom - pp * math.log(d - 1) + log_h[None, :]),
                                0.0), axis=1)
        pref = 0.5 * math.log(math.pi) - special.gammaln(d / 2) - (d - 1) * math.log(2.0)
        out = np.sum(np.exp(log_base + pref) * inner[:, None], axis=0)
    return out.reshape(v.shape)


def positive_mse_gaussian_form(v, sq_x, sq_y, num_features, dim, coupling):
    """Theorem 3.2 (SimRF eq. 11) for the softmax kernel: MSE of M positive RFs under a coupling.

    MSE = e^{−||x||²−||y||²}/M · ((e^{2v²} − e^{v²}) + (M−1)(ρ̄ − e^{v²})), where ρ̄ averages the
    conformity over ordered pairs of rows: same-block pairs are coupled, other pairs independent.
    (The paper's Gaussian-kernel form carries e^{−2||x||²−2||y||²}; SM = e^{(||x||²+||y||²)/2}·K.)
    """
    v = np.asarray(v, np.float64)
    frac = same_block_pair_fraction(num_features, dim)
    ev2 = np.exp(v * v)
    rho = frac * conformity(v, dim, coupling) + (1.0 - frac) * ev2
    m = num_features
    return np.exp(-np.asarray(sq_x) - np.asarray(sq_y)) / m * ((ev2 * ev2 - ev2) + (m - 1) * (rho - ev2))


def same_block_pair_fraction(num_features, dim):
    """Fraction of ordered pairs (i ≠ j) of the M rows that fall in the same block of d."""
    if num_features < 2:
        return 0.0
    full, rest = divmod(num_features, dim)
    same = full * dim * (dim - 1) + rest * (rest - 1)
    return same / (num_features * (num_features - 1))
