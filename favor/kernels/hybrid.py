"""Hybrid random features (HRF): Ŝ = λ̂·Ŝ₊₊ + (1 − λ̂)·Ŝ_trig with independent base estimators.

Ŝ₊₊ is the antithetic positive estimator (accurate where x ≈ −y) and Ŝ_trig the trigonometric one
(accurate where x ≈ y); λ̂ leans on each where it is good. Variants (registry names):

- "hrf-angular":  λ(x,y) = θ_xy/π, λ̂ = ½ − (1/2n) Σ_j sgn(τ_jᵀx) sgn(τ_jᵀy)   (Lemma 3.2)
- "hrf-gaussian": λ(x,y) = exp(−σ²||x+y||²/2), λ̂ = (1/n) Σ_j cos(σ τ_jᵀ(x+y)), the trigonometric
                  estimate of a Gaussian kernel between x and −y. Decision: the HRF copy in papers/
                  names this variant without its formula; this λ is the one that fits the paper's
                  template λ = a + E_τ[f₁(x,τ) f₂(y,τ)] with complex-exponential f's and that goes to 1
                  where Ŝ₊₊ is exact (x = −y).
- "hrf-cluster":  queries and keys are clustered (k-means); for the cluster pair (i, j) a constant
                  λ_ij = MSE_trig/(MSE₊₊ + MSE_trig) at the centres, the minimiser of Theorem 3.1's
                  λ²MSE₊₊ + (1−λ)²MSE_trig; query features are rescaled per key cluster and key
                  features routed to their cluster's slot.

Any λ̂ = a + ρ_q(x)ᵀρ_k(y) linearises through tensor products (HRF Lemma 2.3):
    φ_q = [√a φ₊(x), ρ_q(x)⊗φ₊(x), √(1−a) φ_t(x), −ρ_q(x)⊗φ_t(x)]
    φ_k = [√a φ₊(y), ρ_k(y)⊗φ₊(y), √(1−a) φ_t(y),  ρ_k(y)⊗φ_t(y)]
so φ_q ≠ φ_k and the features are NOT positive (`positive = False`): the attention normaliser must
guard the sign of its denominator. `num_features` is m, the frequencies of each base estimator.

hrf-angular uses an equal linearisation without that form's cancellation: λ̂ = (1/n) Σ_j [s_j(x) ≠ s_j(y)]
with s_j = sgn(τ_jᵀ·), so with indicators P_j = [s_j > 0], N_j = [s_j < 0],
    λ̂ = (1/n) Σ_j (P_j(x)N_j(y) + N_j(x)P_j(y)),   1 − λ̂ = (1/n) Σ_j (P_j(x)P_j(y) + N_j(x)N_j(y)),
    φ_q = [P⊗φ₊, N⊗φ₊, P⊗φ_t, N⊗φ_t](x)/√n,   φ_k = [N⊗φ₊, P⊗φ₊, P⊗φ_t, N⊗φ_t](y)/√n:
every λ-weight is an exact 0 or 1/n, so nothing cancels but the trig estimator's own signs. (Lemma 2.3's
a + ρᵀρ sums ½ and ±½ per pair: where λ̂ = 1 its (1 − λ̂)·Ŝ_trig is a difference of two equal float32
sums of |Ŝ_trig|, noise ~1e-7 of a quantity up to 1e11 times the true denominator at ‖x‖ ≈ 2.) Width
8·n·m: 4m(n + 1) at n = 1, the default.
"""

from __future__ import annotations

import abc
import math

import jax
import jax.numpy as jnp

from favor.kernels.base import (Mechanism, check_num_features, check_rows, check_sets, log_abs_sign, pytree_dataclass, static)
from favor.kernels.couplings import Projections, draw_groups
from favor.kernels import stats
from favor.kernels.sincos import sin_cos_features

KMEANS_ITERS = 10
ZERO_LOG = -1e4   # log of an exact zero feature (exp underflows to 0.0 in float32)


@pytree_dataclass
class HybridDraw:
    pos: Projections    # [m, d] for the antithetic positive estimator
    trig: Projections   # [m, d] for the trigonometric estimator, independent of pos
    lam: Projections    # [n, d] projections τ of the λ estimator (unused by hrf-cluster)


@pytree_dataclass
class HybridParams:
    q_centers: jax.Array  # [..., cq, d] (hrf-cluster; empty otherwise)
    k_centers: jax.Array  # [..., ck, d]
    lam: jax.Array        # [..., cq, ck]
    dim: int = static(0)


_log_abs_sign = log_abs_sign


def _positive_block(u, w):
    """Antithetic positive features exp(±ωᵀu − ||u||²/2)/√(2m): log-abs only (positive)."""
    proj = u @ jnp.swapaxes(w.omega, -1, -2)
    m = w.omega.shape[-2]
    base = -0.5 * jnp.sum(u * u, -1, keepdims=True) - 0.5 * math.log(2 * m)
    return jnp.concatenate([proj, -proj], -1) + base


def _trig_block(u, w):
    proj = u @ jnp.swapaxes(w.omega, -1, -2)
    m = w.omega.shape[-2]
    la, sg = _log_abs_sign(sin_cos_features(proj))
    return la + 0.5 * jnp.sum(u * u, -1, keepdims=True) - 0.5 * math.log(m), sg


def _base_blocks(u, w):
    """(log-scale [..., L, 1], antithetic positive values [..., L, 2m], trig values [..., L, 2m]): both base
    estimators' features as e^scale · values with |values| ≤ 1, the scale the larger of the two blocks'
    (the positive block normalised by its row maximum, the trig block by its norm factor). A block far
    below the other underflows to 0: below the float32 rounding of the other's terms."""
    lp = _positive_block(u, w.pos)
    scale_p = jax.lax.stop_gradient(jnp.max(lp, -1, keepdims=True))
    vt = sin_cos_features(u @ jnp.swapaxes(w.trig.omega, -1, -2))
    scale_t = 0.5 * jnp.sum(u * u, -1, keepdims=True) - 0.5 * math.log(w.trig.omega.shape[-2])
    scale = jax.lax.stop_gradient(jnp.maximum(scale_p, scale_t))
    return scale, jnp.exp(lp - scale), vt * jnp.exp(scale_t - scale)   # ≤ 1: scale ≥ each block's maximum


def _lemma22_log_mse(x, y):
    """log of (2m)·MSE for Ŝ₊₊ and Ŝ_trig (HRF Lemma 2.2), every pair."""
    sq_x = jnp.sum(x * x, -1)[..., :, None]
    sq_y = jnp.sum(y * y, -1)[..., None, :]
    xy = x @ jnp.swapaxes(y, -1, -2)
    z2 = jnp.maximum(sq_x + sq_y + 2 * xy, 0.0)
    d2 = jnp.maximum(sq_x + sq_y - 2 * xy, 0.0)
    log_pos = z2 + 2 * xy + 2 * jnp.log(-jnp.expm1(-z2) + 1e-30)
    log_trig = sq_x + sq_y + 2 * jnp.log(-jnp.expm1(-d2) + 1e-30)
    return log_pos, log_trig


class _HybridBase(Mechanism):
    """Draw and feature plumbing shared by the bipolar and clustering variants."""

    positive = False
    data_dependent = False
    n = 1

    def fit(self, x, y, x_mask=None, y_mask=None):
        x, _ = check_sets(x, y, x_mask, y_mask)
        empty = jnp.zeros((0, x.shape[-1]), jnp.float32)
        return HybridParams(q_centers=empty, k_centers=empty, lam=jnp.zeros((0, 0)), dim=x.shape[-1])

    def draw(self, key, num_features, params, coupling="iid"):
        return self.draw_base(key, num_features, params.dim, coupling)

    def draw_base(self, key, num_features, dim, coupling="iid"):
        m = check_num_features(num_features)
        pos, trig, lam = draw_groups(key, (m, m, self.n), dim, coupling)
        return HybridDraw(pos=pos, trig=trig, lam=lam)

    def query_log_features(self, x, w, params):
        return self._features(x, w, params, "q")

    def key_log_features(self, y, w, params):
        return self._features(y, w, params, "k")

    @abc.abstractmethod
    def _features(self, u, w, params, side):
        """(log|φ|, sign) of the query (side 'q') or key ('k') map."""


class Hybrid(_HybridBase):
    """Bipolar HRF with λ̂ = a + ρ_q(x)ᵀρ_k(y)."""

    a = 0.0

    def __init__(self, **options):
        self.options = options
        self.n = int(options.get("num_lambda_features", 8))
        if self.n < 1:
            raise ValueError(f"{self.name}: num_lambda_features must be ≥ 1; got {self.n}")

    @abc.abstractmethod
    def _rho(self, u, w, side):
        """(log|ρ|, sign) of the λ-estimator features, [..., L, R]."""

    @abc.abstractmethod
    def _rho_dim(self):
        """R, the width of ρ."""

    @abc.abstractmethod
    def _lambda_moments(self, x, y, params):
        """(E[λ̂²], E[(1 − λ̂)²]) for every pair, iid τ."""

    def feature_dim(self, num_features):
        r = self._rho_dim()
        return (2 * num_features) * (r + 1 + (1 if self.a > 0 else 0)) + 2 * num_features * r

    def _features(self, u, w, params, side):
        """(log-scale [..., L, 1], values [..., L, F]) with |values| ≤ 1 (base.py's second form): the base
        blocks (`_base_blocks`) and the ρ⊗ blocks formed by multiplying values, so no exp or log touches
        the [L, F] features."""
        u = check_rows(u, params.dim, f"{self.name} features").astype(jnp.float32)
        scale, vp, vt = _base_blocks(u, w)
        lr, sr = self._rho(u, w, side)
        rho = sr * jnp.exp(lr)                                      # |ρ| ≤ 1
        outer = lambda r, f: (r[..., :, None] * f[..., None, :]).reshape(*f.shape[:-1], -1)
        neg = -1.0 if side == "q" else 1.0
        blocks = [math.sqrt(self.a) * vp] if self.a > 0 else []
        blocks += [outer(rho, vp), math.sqrt(1.0 - self.a) * vt, neg * outer(rho, vt)]
        return scale, jnp.concatenate(blocks, -1)

    def variance(self, x, y, params, num_features, coupling="iid"):
        """Theorem 3.1: MSE = E[λ̂²]·MSE₊₊ + E[(1−λ̂)²]·MSE_trig (independent base estimators)."""
        m = check_num_features(num_features)
        if coupling != "iid":
            raise ValueError(f"{self.name}: the analytic variance is for coupling='iid' only; got {coupling!r}")
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        l2, one_minus_l2 = self._lambda_moments(x, y, params)
        log_pos, log_trig = _lemma22_log_mse(x, y)
        return (l2 * jnp.exp(log_pos) + one_minus_l2 * jnp.exp(log_trig)) / (2.0 * m)


class HybridAngular(Hybrid):
    name = "hrf-angular"
    OPTIONS = {"num_lambda_features": 8}
    a = 0.5

    def _rho_dim(self):
        return self.n

    def _rho(self, u, w, side):
        s = jnp.sign(u @ jnp.swapaxes(w.lam.omega, -1, -2))
        s = jnp.where(s == 0, 1.0, s)
        la = jnp.full_like(s, -0.5 * math.log(2 * self.n))
        return la, (-s if side == "q" else s)

    def feature_dim(self, num_features):
        return 8 * self.n * num_features

    def _features(self, u, w, params, side):
        """The indicator linearisation (module docstring): (log-scale [..., L, 1], values [..., L, 8nm]),
        |values| ≤ 1, base blocks as in Hybrid._features."""
        u = check_rows(u, params.dim, f"{self.name} features").astype(jnp.float32)
        scale, vp, vt = _base_blocks(u, w)
        s = u @ jnp.swapaxes(w.lam.omega, -1, -2)                 # [..., L, n]; sgn 0 counts as +
        pos = (s >= 0).astype(jnp.float32)
        neg = 1.0 - pos
        lam_side = jnp.concatenate([pos, neg] if side == "q" else [neg, pos], -1) / math.sqrt(self.n)
        trig_side = jnp.concatenate([pos, neg], -1) / math.sqrt(self.n)
        outer = lambda r, f: (r[..., :, None] * f[..., None, :]).reshape(*f.shape[:-1], -1)
        return scale, jnp.concatenate([outer(lam_side, vp), outer(trig_side, vt)], -1)

    def _lambda_moments(self, x, y, params):
        nx = jnp.linalg.norm(x, axis=-1)[..., :, None]
        ny = jnp.linalg.norm(y, axis=-1)[..., None, :]
        cos = jnp.clip((x @ jnp.swapaxes(y, -1, -2)) / jnp.maximum(nx * ny, 1e-30), -1.0, 1.0)
        t = jnp.arccos(cos) / math.pi
        n = self.n
        l2 = t * (t - t / n + 1.0 / n)                 # Lemma 3.2
        return l2, 1.0 - 2.0 * t + l2


class HybridGaussian(Hybrid):
    name = "hrf-gaussian"
    OPTIONS = {"num_lambda_features": 8, "sigma": 1.0}
    a = 0.0

    def __init__(self, **options):
        super().__init__(**options)
        self.sigma = float(options.get("sigma", 1.0))
        if not self.sigma > 0:
            raise ValueError(f"hrf-gaussian: sigma must be > 0; got {self.sigma!r}")

    def _rho_dim(self):
        return 2 * self.n

    def _rho(self, u, w, side):
        p = self.sigma * (u @ jnp.swapaxes(w.lam.omega, -1, -2))
        sin = jnp.sin(p) if side == "q" else -jnp.sin(p)
        la, sg = _log_abs_sign(jnp.concatenate([jnp.cos(p), sin], -1))
        return la - 0.5 * math.log(self.n), sg

    def _lambda_moments(self, x, y, params):
        z = x[..., :, None, :] + y[..., None, :, :]
        g = jnp.exp(-0.5 * self.sigma ** 2 * jnp.sum(z * z, -1))
        var = (1.0 - g * g) ** 2 / (2.0 * self.n)      # Var of the mean of n cosines
        return g * g + var, (1.0 - g) ** 2 + var


@pytree_dataclass
class ClusterStats:
    """What hrf-cluster's fit uses: the k-means centres of each set."""
    q_centers: jax.Array   # [..., cq, d]
    k_centers: jax.Array   # [..., ck, d]
    count: jax.Array       # [...] valid rows seen (the smaller set)


def kmeans(u, mask, k, iters=KMEANS_ITERS, init=None):
    """Deterministic k-means on valid rows: farthest-point initialisation (or `init`, e.g. running
    centres, which keeps cluster labels stable from one batch to the next), then Lloyd steps."""
    w = jnp.ones(u.shape[:-1]) if mask is None else jnp.asarray(mask, jnp.float32)
    wn = w / jnp.maximum(jnp.sum(w, -1, keepdims=True), 1.0)
    first = stats.mean(u, wn)[..., None, :]

    def add_center(centers, _):
        d2 = jnp.min(jnp.sum((u[..., :, None, :] - centers[..., None, :, :]) ** 2, -1), -1)
        far = jnp.argmax(jnp.where(w > 0, d2, -1.0), -1)
        new = jnp.take_along_axis(u, far[..., None, None], axis=-2)
        return jnp.concatenate([centers, new], -2), None

    centers = first
    for _ in range(k - 1):
        centers, _ = add_center(centers, None)
    if init is not None:
        centers = jnp.broadcast_to(init, centers.shape)

    def lloyd(centers, _):
        assign = assign_clusters(u, centers)
        onehot = jax.nn.one_hot(assign, k) * w[..., None]
        counts = jnp.sum(onehot, -2)
        sums = jnp.einsum("...lk,...ld->...kd", onehot, u)
        new = jnp.where(counts[..., None] > 0, sums / jnp.maximum(counts, 1.0)[..., None], centers)
        return new, None

    centers, _ = jax.lax.scan(lloyd, centers, None, length=iters)
    return centers


def assign_clusters(u, centers):
    d2 = jnp.sum((u[..., :, None, :] - centers[..., None, :, :]) ** 2, -1)
    return jnp.argmin(d2, -1)


class HybridCluster(_HybridBase):
    name = "hrf-cluster"
    OPTIONS = {"query_clusters": 2, "key_clusters": 2}
    data_dependent = True

    def __init__(self, **options):
        self.options = options
        self.cq = int(options.get("query_clusters", 2))
        self.ck = int(options.get("key_clusters", 2))
        if self.cq < 1 or self.ck < 1:
            raise ValueError(f"hrf-cluster: query_clusters and key_clusters must be ≥ 1; "
                             f"got {self.cq} and {self.ck}")

    def statistics(self, x, y, x_mask=None, y_mask=None, init=None):
        x, y = check_sets(x, y, x_mask, y_mask)
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        start_q = start_k = None
        if init is not None:   # warm start from centres that have seen data; else farthest points
            seen = (init.count > 0)[..., None, None]
            start_q = jnp.where(seen, init.q_centers, kmeans(x, x_mask, self.cq, iters=0))
            start_k = jnp.where(seen, init.k_centers, kmeans(y, y_mask, self.ck, iters=0))
        cq = kmeans(x, x_mask, self.cq, init=start_q)
        ck = kmeans(y, y_mask, self.ck, init=start_k)
        count = jnp.minimum(stats.valid_count(x, x_mask), stats.valid_count(y, y_mask))
        bs = jnp.broadcast_shapes(cq.shape[:-2], ck.shape[:-2])
        return ClusterStats(q_centers=cq, k_centers=ck, count=jnp.broadcast_to(count, bs))

    def fit_statistics(self, s):
        log_pos, log_trig = _lemma22_log_mse(s.q_centers, s.k_centers)
        lam = jax.nn.sigmoid(log_trig - log_pos)       # MSE_trig / (MSE₊₊ + MSE_trig)
        return HybridParams(q_centers=s.q_centers, k_centers=s.k_centers, lam=lam, dim=s.q_centers.shape[-1])

    def fit(self, x, y, x_mask=None, y_mask=None):
        return self.fit_statistics(self.statistics(x, y, x_mask, y_mask))

    def feature_dim(self, num_features):
        return self.ck * 4 * num_features

    def _features(self, u, w, params, side):
        u = check_rows(u, params.dim, f"{self.name} features").astype(jnp.float32)
        lp = _positive_block(u, w.pos)
        lt, st = _trig_block(u, w.trig)
        base_la = jnp.concatenate([lp, lt], -1)               # [..., L, 4m]
        base_sg = jnp.concatenate([jnp.ones_like(lp), st], -1)
        half = lp.shape[-1]
        if side == "q":
            own = assign_clusters(u, params.q_centers)       # [..., L]
            lam = jnp.take_along_axis(params.lam, own[..., :, None], axis=-2)   # [..., L, ck]
            scale = jnp.concatenate([jnp.repeat(lam[..., :, :, None], half, -1),
                                     jnp.repeat(1.0 - lam[..., :, :, None], half, -1)], -1)
            log_scale = jnp.log(jnp.maximum(scale, 1e-38))
        else:
            own = assign_clusters(u, params.k_centers)
            hit = jax.nn.one_hot(own, self.ck)               # [..., L, ck]
            log_scale = jnp.where(hit > 0, 0.0, ZERO_LOG)[..., None] * jnp.ones((2 * half,))
        la = base_la[..., None, :] + log_scale               # [..., L, ck, 4m]
        sg = jnp.broadcast_to(base_sg[..., None, :], la.shape)
        return la.reshape(*la.shape[:-2], -1), sg.reshape(*sg.shape[:-2], -1)

    def variance(self, x, y, params, num_features, coupling="iid"):
        """λ is deterministic per cluster pair: MSE = λ²MSE₊₊ + (1 − λ)²MSE_trig."""
        m = check_num_features(num_features)
        if coupling != "iid":
            raise ValueError(f"{self.name}: the analytic variance is for coupling='iid' only; got {coupling!r}")
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        iq, ik = assign_clusters(x, params.q_centers), assign_clusters(y, params.k_centers)
        lam = jnp.take_along_axis(params.lam, iq[..., :, None], axis=-2)          # [..., Lx, ck]
        lam = jnp.take_along_axis(lam, jnp.broadcast_to(ik[..., None, :], (*lam.shape[:-1], ik.shape[-1])), -1)
        log_pos, log_trig = _lemma22_log_mse(x, y)
        return (lam ** 2 * jnp.exp(log_pos) + (1 - lam) ** 2 * jnp.exp(log_trig)) / (2.0 * m)
