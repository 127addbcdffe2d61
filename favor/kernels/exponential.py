"""Exponential random features on Gaussian projections: FAVOR+, FAVOR++ and FAVOR#.

All of them are one map in a transformed basis (MATH.md, "Dense-exponential RFs"):

    log f_q(ω, x) = Σ_l [¼ log(1 − 4a_l) + a_l ω_l² + √(1 − 4a_l) ω_l x'_l] − ½||x'||²,   x' = x·T_q
    log f_k(ω, y) = the same with y' = y·T_k,                                      T_q T_kᵀ = I

so that x'ᵀy' = xᵀy and E_ω[f_q f_k] = exp(xᵀy) for ω ~ N(0, I). The mechanisms differ only in
how fit chooses (T_q, T_k, a):

    positive   T = I,                 a = 0                        (FAVOR+, Performer)
    gerf/oprf  T = I,                 a_l = A* from ρ*(v̄, d)       (FAVOR++, CRT Thm 3.3 + eq. 8)
    saderf     T_q = Ψ, T_k = Ψ⁻¹,    Ψ diagonal, then OPRF        (FAVOR#)
    aderf      T_q = Q, T_k = Q⁻¹,    Q = P^½ (geometric mean), then OPRF
    sderf      T_q = T_k = U,         a_l = ρ*(λ_l, 1) per eigendirection of N

Optimal importance sampling ("All RF representations are equivalent", Thm 1) is an option of every
mechanism here: ω is drawn from the Gaussian proposal p_Ψ ∝ p_Ω·q fitted under a Gaussian model of
the (transformed) data, and log p_Ω(ω)/p_Ψ(ω) is carried in the draw's log-weights, half of it in
each feature map, so the estimate stays unbiased.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from favor.kernels import stats
from favor.kernels.base import Mechanism, check_num_features, check_rows, check_sets, pytree_dataclass, static
from favor.kernels.couplings import Projections, check_coupling, gaussian_projections, positive_mse_gaussian_form

# Floor on the eigenvalues of I − 2(G_x + G_y), the whitened proposal precision. Below it the
# optimal proposal does not exist (the data are so spread that q(ω) is not integrable against
# p_Ω); flooring keeps a valid, wider Gaussian proposal and the estimator unbiased.
IS_PRECISION_FLOOR = 1.0 / 16.0


@pytree_dataclass
class ExpParams:
    """Fitted parameters of an exponential mechanism (leading dims: batch, heads)."""
    tq: jax.Array          # [..., d, d]  x' = x @ tq
    tk: jax.Array          # [..., d, d]  y' = y @ tk,  tq @ tkᵀ = I
    a: jax.Array           # [..., d]     a_l < 1/8 in the transformed basis
    prop_mean: jax.Array   # [..., d]     importance-sampling proposal N(mean, Λ⁻¹)
    prop_prec: jax.Array   # [..., d, d]  Λ
    prop_scale: jax.Array  # [..., d, d]  Λ^(-1/2)
    prop_logdet: jax.Array  # [...]       log det Λ
    importance: bool = static(False)
    # "identity" | "diagonal" | "orthogonal" | "dense": lets the feature map skip work (an identity
    # or orthogonal T keeps ||x'|| = ||x||; T folds into the projection either way)
    transform: str = static("dense")
    # a_l the same for every l (OPRF's A*, GERF's a, FAVOR+'s 0): with an identity or diagonal T the whole
    # map then has one projection matrix for every batch element and head (_log_features)
    uniform_a: bool = static(False)

    @property
    def dim(self):
        return self.a.shape[-1]


def identity_params(batch_shape, d, a=None):
    eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (*batch_shape, d, d))
    a = jnp.zeros((*batch_shape, d), jnp.float32) if a is None else a
    return ExpParams(tq=eye, tk=eye, a=a, prop_mean=jnp.zeros((*batch_shape, d), jnp.float32),
                     prop_prec=eye, prop_scale=eye, prop_logdet=jnp.zeros(batch_shape, jnp.float32))


def _mT(m):
    return jnp.swapaxes(m, -1, -2)


def _shared_draw(params, w):
    """Whether a per-head fit with one a for every coordinate (T identity or diagonal) meets a draw shared
    by every head: the map then has one projection matrix for all of them (`_shared_log_features`)."""
    return (params.uniform_a and params.transform in ("identity", "diagonal") and params.a.ndim > 1
            and w.omega.ndim == 2 and w.log_weights.ndim == 1)


def _importance_proposal(mt, a):
    """Gaussian proposal p_Ψ ∝ p_Ω·q for f² = D² exp(2Σa_lω_l² + 2ωᵀBx' − ||x'||²), B = diag(√(1−4a)).

    Under x' ~ N(μ_x, Σ_x): log E_x f² = ωᵀ(2 diag(a) + 2 B G_x B)ω + 2ωᵀB m_x + const with
    G = Σ(I + 2Σ)⁻¹ and m = (I + 2Σ)⁻¹μ; q is the geometric mean of the two sides, so
    p_Ψ = N(Λ⁻¹B(m_x + m_y), Λ⁻¹) with Λ = B(I − 2(G_x + G_y))B. `mt`: moments of the transformed sets.
    """
    d = a.shape[-1]
    eye = jnp.eye(d, dtype=jnp.float32)
    outer = lambda u: u[..., :, None] * u[..., None, :]
    mu_x, mu_y = mt.mean_x, mt.mean_y
    cov_x, cov_y = mt.second_x - outer(mu_x), mt.second_y - outer(mu_y)
    cov = jnp.stack([cov_x, cov_y])
    # one batched inverse for both sides: independent LAPACK calls can deadlock XLA:CPU (couplings.py)
    inv = jnp.linalg.inv(eye + 2.0 * cov)
    g = 0.5 * (cov @ inv + _mT(cov @ inv))
    gx, gy = g[0], g[1]
    mx = jnp.einsum("...de,...e->...d", inv[0], mu_x)
    my = jnp.einsum("...de,...e->...d", inv[1], mu_y)
    lam_k, u_k = stats.eigh(eye - 2.0 * (gx + gy))
    k = (u_k * jnp.maximum(lam_k, IS_PRECISION_FLOOR)[..., None, :]) @ _mT(u_k)
    b = jnp.sqrt(1.0 - 4.0 * a)
    prec = b[..., :, None] * k * b[..., None, :]
    lam, u = stats.eigh(prec)
    scale = (u * jax.lax.rsqrt(lam)[..., None, :]) @ _mT(u)
    mean = jnp.einsum("...de,...e->...d", scale @ scale, b * (mx + my))
    return mean, prec, scale, jnp.sum(jnp.log(lam), axis=-1)


def _oprf_a(m):
    """OPRF's A* (CRT Thm 3.3 with eq. 8's statistic), the same for every coordinate: [..., d]."""
    d = m.mean_x.shape[-1]
    return jnp.broadcast_to(stats.optimal_a(m.mean_pair_sq_norm(), d)[..., None], m.mean_x.shape)


class ExponentialMechanism(Mechanism):
    """Shared feature maps, draws and second moments of the exponential family."""

    positive = True
    OPTIONS = {"importance_sampling": False}
    TRANSFORM = "identity"
    UNIFORM_A = True      # _transforms' a: OPRF's A* for every coordinate (SDERF: one per eigendirection)

    def __init__(self, **options):
        self.options = options
        self.importance = bool(options.get("importance_sampling", False))

    # -- fit -------------------------------------------------------------------------------------
    def _transforms(self, m):
        """(tq, tk, a) for this mechanism from the moments `m`; default: identity, OPRF's A*."""
        p = identity_params(m.count.shape, m.mean_x.shape[-1])
        return p.tq, p.tk, _oprf_a(m)

    def statistics(self, x, y, x_mask=None, y_mask=None, init=None):
        x, y = check_sets(x, y, x_mask, y_mask)
        return stats.moments(x.astype(jnp.float32), y.astype(jnp.float32), x_mask, y_mask,
                             full=self._full_moments())

    def layer_statistics(self, x, y, x_mask=None, y_mask=None):
        """`statistics` of an attention layer's scaled queries x [B, Lx, H, d] and keys y [B, Ly, H, d]
        in its own layout, masks [B, L]: per batch and head, [B, H, ...] (stats.layer_moments)."""
        return stats.layer_moments(x, y, x_mask, y_mask, full=self._full_moments())

    def _full_moments(self):
        # identity and diagonal transforms read only the second moments' diagonals (OPRF: their traces;
        # SADERF: per coordinate); rotations (SDERF), dense transforms (ADERF) and importance sampling's
        # proposal need the whole matrices
        return self.importance or self.TRANSFORM in ("orthogonal", "dense")

    def fit_statistics(self, m):
        bs, d = m.count.shape, m.mean_x.shape[-1]
        tq, tk, a = self._transforms(m)
        tq, tk = jnp.broadcast_to(tq, (*bs, d, d)), jnp.broadcast_to(tk, (*bs, d, d))
        a = jnp.broadcast_to(a, (*bs, d))
        # statistics of no data (a causal layer before its first training step): the data-independent
        # member of the family, positive RFs, not whatever a transform of zero matrices gives
        seen = (m.count > 0)[..., None]
        eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), tq.shape)
        tq, tk = jnp.where(seen[..., None], tq, eye), jnp.where(seen[..., None], tk, eye)
        a = jnp.where(seen, a, 0.0)
        if not self.importance:
            return dataclasses.replace(identity_params(bs, d, a), tq=tq, tk=tk, transform=self.TRANSFORM,
                                       uniform_a=self.UNIFORM_A)
        mean, prec, scale, logdet = _importance_proposal(m.transformed(tq, tk), a)
        return ExpParams(tq=tq, tk=tk, a=a, prop_mean=mean, prop_prec=prec, prop_scale=scale,
                         prop_logdet=logdet, importance=True, transform=self.TRANSFORM, uniform_a=self.UNIFORM_A)

    def fit(self, x, y, x_mask=None, y_mask=None):
        return self.fit_statistics(self.statistics(x, y, x_mask, y_mask))

    # -- draw ------------------------------------------------------------------------------------
    def draw(self, key, num_features, params, coupling="iid"):
        return self.adapt_draw(self.draw_base(key, num_features, params.dim, coupling), params)

    def draw_base(self, key, num_features, dim, coupling="iid"):
        check_num_features(num_features)
        check_coupling(coupling)
        z = gaussian_projections(key, num_features, dim, coupling)
        return Projections(omega=z, log_weights=jnp.zeros((num_features,), jnp.float32))

    def adapt_draw(self, base, params):
        """An orthogonal transform U (SDERF's eigenvectors) meets the draw as Uᵀz: the map's projection
        U·diag(√(1−4a))·Uᵀz and quadratic zᵀU·diag(a)·Uᵀz are then functions of U·diag(·)·Uᵀ only, the
        same for any eigenbasis of a repeated or nearly repeated eigenvalue (eigensolvers, and a jit and
        an eager call, pick different ones; read in the eigenbasis, z would be rotated by that choice: a
        different draw for the same data). Uᵀz is the same standard (coupled) draw in distribution.
        Importance sampling then moves it to the proposal: ω = μ + S z."""
        if params.transform == "orthogonal":
            base = Projections(omega=base.omega @ params.tq, log_weights=base.log_weights)
        if not params.importance:
            return base
        z = base.omega
        omega = params.prop_mean[..., None, :] + z @ params.prop_scale  # scale is symmetric
        log_w = (-0.5 * jnp.sum(omega * omega, -1) + 0.5 * jnp.sum(z * z, -1)
                 - 0.5 * params.prop_logdet[..., None])
        return Projections(omega=omega, log_weights=log_w)

    # -- features --------------------------------------------------------------------------------
    def _log_features(self, u, t, w, params):
        u = check_rows(u, params.dim, f"{self.name} features").astype(jnp.float32)
        if _shared_draw(params, w):
            return self._shared_log_features(u, t, w, params), None
        wmat, const, sq = self._linear_form(u, t, w, params)
        m = w.omega.shape[-2]
        # One matmul gives the whole log-feature: [u, ||T u||², 1] @ [W; −½; const]. Adding the row
        # and column terms to an [L, M] product afterwards costs XLA:CPU a pass over (and a
        # broadcast copy of) the largest array of the layer (BENCHMARKS.md, design-measurements).
        batch = jnp.broadcast_shapes(wmat.shape[:-2], const.shape[:-1])
        mat = jnp.concatenate([jnp.broadcast_to(wmat, (*batch, *wmat.shape[-2:])),
                               jnp.full((*batch, 1, m), -0.5, jnp.float32),
                               jnp.broadcast_to(const, (*batch, m))[..., None, :]], -2)
        aug = jnp.concatenate([u, sq, jnp.ones_like(sq)], -1)
        return aug @ mat, None

    def _linear_form(self, u, t, w, params):
        """(P [.., d, M], c [.., M], ||u·T||² [.., L, 1]) with log f = u·P + c − ½||u·T||²: the map of any
        (T, a), T folded into the projection."""
        a, m, kind = params.a, w.omega.shape[-2], params.transform
        wb = w.omega * jnp.sqrt(1.0 - 4.0 * a)[..., None, :]          # rows √(1−4a_l)·ω_l
        # per-feature constant: Σ_l ¼log(1−4a_l) + a_l ω_l², half the log-weight, and 1/√M
        const = (0.25 * jnp.sum(jnp.log1p(-4.0 * a), -1)[..., None]
                 + jnp.einsum("...md,...d->...m", w.omega * w.omega, a)
                 + 0.5 * w.log_weights - 0.5 * math.log(m))
        wmat = _mT(wb) if kind == "identity" else t @ _mT(wb)
        if kind in ("identity", "orthogonal"):
            sq = jnp.sum(u * u, -1, keepdims=True)
        elif kind == "diagonal":
            sq = (u * u) @ (jnp.diagonal(t, axis1=-2, axis2=-1) ** 2)[..., :, None]
        else:
            ut = u @ t
            sq = jnp.sum(ut * ut, -1, keepdims=True)
        return wmat, const, sq

    def _shared_log_features(self, u, t, w, params):
        """The map of a per-head fit with one a for every coordinate and a draw shared by every head: the
        per-head factors go into the rows, [u'·√(1−4a), ||u'||², 1, a, ¼d·log(1−4a)] @ [ωᵀ; −½; c; ||ω||²; 1]
        with u' = u·T (T identity or diagonal) and c the per-feature log-weight and 1/√M, so one [d + 4, M]
        matrix serves every batch element and head (a constant of the program for a fixed draw) and the
        projection is one matrix product, not one per head."""
        d, m = params.dim, w.omega.shape[-2]
        a = params.a[..., :1, None]                                          # [..., 1, 1]
        if params.transform == "diagonal":
            u = u * jnp.diagonal(t, axis1=-2, axis2=-1)[..., None, :]
        sq = jnp.sum(u * u, -1, keepdims=True)
        ones = jnp.ones_like(sq)
        rows = jnp.concatenate([u * jnp.sqrt(1.0 - 4.0 * a), sq, ones, a * ones,
                                0.25 * d * jnp.log1p(-4.0 * a) * ones], -1)
        const = 0.5 * w.log_weights - 0.5 * math.log(m)
        mat = jnp.concatenate([_mT(w.omega), jnp.full((1, m), -0.5, jnp.float32), const[None],
                               jnp.sum(w.omega * w.omega, -1)[None], jnp.ones((1, m), jnp.float32)], 0)
        return rows @ mat

    def log_linear(self, u, t, w, params):
        """The map as a log-linear form for the fused kernels (favor.attention.fused):
        (u' [.., L, D], r [.., L], P [.., D, M], c [.., M]) with log φ(u) = u'·P + c + r, equal to
        `_log_features(u, t, w, params)`. The transform folds into P (dense, orthogonal) or into u'
        (diagonal with one a, where P is then the shared draw itself); r is the row's −½||u·T||²."""
        u = check_rows(u, params.dim, f"{self.name} features").astype(jnp.float32)
        if _shared_draw(params, w):
            a1, m = params.a[..., :1], w.omega.shape[-2]                      # [..., 1]
            if params.transform == "diagonal":
                u = u * jnp.diagonal(t, axis1=-2, axis2=-1)[..., None, :]
            row = -0.5 * jnp.sum(u * u, -1) + (0.25 * params.dim * jnp.log1p(-4.0 * a1))
            const = (0.5 * w.log_weights - 0.5 * math.log(m)
                     + a1 * jnp.sum(w.omega * w.omega, -1))                 # [..., M]
            return u * jnp.sqrt(1.0 - 4.0 * a1)[..., None, :], row, _mT(w.omega), const
        proj, const, sq = self._linear_form(u, t, w, params)
        row = -0.5 * sq[..., 0]
        return u, row, proj, const

    def query_log_linear(self, x, w, params):
        return self.log_linear(x, params.tq, w, params)

    def key_log_linear(self, y, w, params):
        return self.log_linear(y, params.tk, w, params)

    def query_log_features(self, x, w, params):
        return self._log_features(x, params.tq, w, params)

    def key_log_features(self, y, w, params):
        return self._log_features(y, params.tk, w, params)

    # -- analysis --------------------------------------------------------------------------------
    def log_second_moment(self, x, y, params):
        """log E_Ψ[(p_Ω/p_Ψ)² f_q² f_k²] in closed form (Gaussian integrals); no IS: Λ = I, μ = 0.

        = Σ log(1−4a) − ||x'||² − ||y'||² − ½ log det Λ − ½ log det Q + ½ hᵀQ⁻¹h + ½ μᵀΛμ,
        Q = 2B² − Λ, h = 2B(x' + y') − Λμ.
        """
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        xt, yt = x @ params.tq, y @ params.tk
        a = params.a
        b = jnp.sqrt(1.0 - 4.0 * a)
        lam, mu = params.prop_prec, params.prop_mean
        q = 2.0 * (jnp.eye(a.shape[-1]) * (b * b)[..., None, :]) - lam
        q_lam, q_vec = jnp.linalg.eigh(q)   # one symmetric factorisation gives Q⁻¹ and log det Q
        q_inv = (q_vec / q_lam[..., None, :]) @ _mT(q_vec)
        lam_mu = jnp.einsum("...de,...e->...d", lam, mu)
        hx = 2.0 * xt * b[..., None, :] - lam_mu[..., None, :]
        hy = 2.0 * yt * b[..., None, :]
        quad = (jnp.einsum("...id,...de,...ie->...i", hx, q_inv, hx)[..., :, None]
                + 2.0 * jnp.einsum("...id,...de,...je->...ij", hx, q_inv, hy)
                + jnp.einsum("...jd,...de,...je->...j", hy, q_inv, hy)[..., None, :])
        const = (jnp.sum(jnp.log1p(-4.0 * a), -1) - 0.5 * params.prop_logdet
                 - 0.5 * jnp.sum(jnp.log(q_lam), -1) + 0.5 * jnp.sum(mu * lam_mu, -1))
        return (const[..., None, None] + 0.5 * quad - jnp.sum(xt * xt, -1)[..., :, None]
                - jnp.sum(yt * yt, -1)[..., None, :])


class Positive(ExponentialMechanism):
    """FAVOR+ positive RFs: φ(u) = exp(ωᵀu − ||u||²/2)/√M; antithetic adds exp(−ωᵀu − ||u||²/2)."""

    name = "positive"
    OPTIONS = {"antithetic": False, "importance_sampling": False}

    def __init__(self, **options):
        super().__init__(**options)
        self.antithetic = bool(options.get("antithetic", False))
        if self.antithetic and self.importance:
            raise ValueError("positive: antithetic=True needs a proposal symmetric about 0, which "
                             "importance_sampling=True does not give; choose one of the two")

    @property
    def data_dependent(self):
        return self.importance

    def _transforms(self, m):
        p = identity_params(m.count.shape, m.mean_x.shape[-1])
        return p.tq, p.tk, p.a

    def feature_dim(self, num_features):
        return 2 * num_features if self.antithetic else num_features

    def draw_base(self, key, num_features, dim, coupling="iid"):
        # In the base draw (not only in draw): a model stores the base draw, and its calls must use the
        # antithetic pairs too. Antithetic excludes importance sampling, so adapt_draw keeps the pairs.
        w = super().draw_base(key, num_features, dim, coupling)
        if not self.antithetic:
            return w
        # ±ω each carry half the weight: the 1/√M of each map becomes 1/√(2M) over 2M features
        return Projections(omega=jnp.concatenate([w.omega, -w.omega], axis=-2),
                           log_weights=jnp.concatenate([w.log_weights, w.log_weights], axis=-1))

    def variance(self, x, y, params, num_features, coupling="iid"):
        """iid: Var/M; antithetic: HRF Lemma 2.2; orthogonal/simplex: SimRF Theorem 3.2."""
        num_features = check_num_features(num_features)
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        if params.importance and coupling != "iid":
            raise ValueError("positive: the analytic variance with importance sampling is for "
                             f"coupling='iid' only; got {coupling!r}")
        check_coupling(coupling)
        sq_x = jnp.sum(x * x, -1)[..., :, None]
        sq_y = jnp.sum(y * y, -1)[..., None, :]
        xy = x @ _mT(y)
        v2 = sq_x + sq_y + 2.0 * xy
        if self.antithetic:
            if coupling != "iid":
                raise ValueError("positive: the antithetic variance formula is for coupling='iid'")
            # (1/2m)·e^{||z||²}·SM²·(1 − e^{−||z||²})²
            return jnp.exp(v2 + 2.0 * xy) * jnp.expm1(-v2) ** 2 / (2.0 * num_features)
        if coupling == "iid":
            return super().variance(x, y, params, num_features)
        if coupling == "simplex+":
            raise ValueError("positive: SimRF+ has no closed-form MSE (the paper optimises it "
                             "numerically); use 'iid', 'orthogonal' or 'simplex'")
        mse = positive_mse_gaussian_form(np.sqrt(np.maximum(np.asarray(v2, np.float64), 0.0)),
                                         np.asarray(sq_x, np.float64), np.asarray(sq_y, np.float64),
                                         num_features, x.shape[-1], coupling)
        return jnp.asarray(mse, jnp.float32)


class GERF(ExponentialMechanism):
    """GERF (CRT eq. 4, s = +1, real A): T = I, a_l = A. Default A is OPRF's A* (Theorem 3.3)."""

    name = "gerf"
    OPTIONS = {"a": None, "importance_sampling": False}

    def __init__(self, **options):
        super().__init__(**options)
        self.a = options.get("a")
        if self.a is not None and not (isinstance(self.a, (int, float)) and self.a < 0.125):
            raise ValueError(f"gerf: a must be a real number below 1/8 (or None for OPRF's optimum); "
                             f"got {self.a!r}")

    @property
    def data_dependent(self):
        return self.a is None or self.importance

    def _transforms(self, m):
        tq, tk, a = super()._transforms(m)
        if self.a is not None:
            a = jnp.full_like(a, float(self.a))
        return tq, tk, a


class OPRF(ExponentialMechanism):
    """Optimal positive RFs (FAVOR++): GERF with A = (1 − 1/ρ*)/8, ρ* from the set statistics."""

    name = "oprf"


class SADERF(ExponentialMechanism):
    """Simplified asymmetric DERF: x → Ψx, y → Ψ⁻¹y, ψ_l = (E y_l² / E x_l²)^¼, then OPRF."""

    name = "saderf"
    TRANSFORM = "diagonal"

    def _transforms(self, m):
        tiny = 1e-12
        diag = lambda a: jnp.diagonal(a, axis1=-2, axis2=-1)
        psi = ((diag(m.second_y) + tiny) / (diag(m.second_x) + tiny)) ** 0.25
        eye = jnp.eye(psi.shape[-1], dtype=jnp.float32)
        tq, tk = eye * psi[..., None, :], eye / psi[..., None, :]
        return tq, tk, _oprf_a(m.transformed(tq, tk))


class ADERF(ExponentialMechanism):
    """Asymmetric DERF: T_q = Q, T_k = Q⁻¹ with Q = P^½, P the geometric mean of M₁⁻¹ and M₂.

    P = M₁^(−½)(M₁^½ M₂ M₁^½)^½ M₁^(−½) solves P M₁ P = M₂ and minimises tr(P M₁) + tr(P⁻¹ M₂),
    the only Q-dependent part of the objective; then OPRF's A* on the transformed sets.
    """

    name = "aderf"
    TRANSFORM = "dense"

    def _transforms(self, m):
        m1, m2 = m.second_x, m.second_y
        r1, r1_inv = stats.sym_sqrt_and_inv(m1)
        c_half, _ = stats.sym_sqrt_and_inv(r1 @ m2 @ r1)
        p = r1_inv @ c_half @ r1_inv
        q, q_inv = stats.sym_sqrt_and_inv(0.5 * (p + _mT(p)))
        return q, q_inv, _oprf_a(m.transformed(q, q_inv))


class SDERF(ExponentialMechanism):
    """Symmetric DERF: N = M₁ + M₂ + x̄ȳᵀ + ȳx̄ᵀ = U diag(λ) Uᵀ, a_l = (1 − 1/ρ*(λ_l, 1))/8."""

    name = "sderf"
    TRANSFORM = "orthogonal"
    UNIFORM_A = False

    def _transforms(self, m):
        cross = m.mean_x[..., :, None] * m.mean_y[..., None, :]
        n = m.second_x + m.second_y + cross + _mT(cross)
        lam, u = stats.eigh(n)
        u = stats.canonical_signs(u)     # the rotation ω meets: the same on every eigensolver
        return u, u, stats.optimal_a(lam, 1)
