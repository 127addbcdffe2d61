"""Discretely-induced random features (CRT §3.2): Poisson and geometric RFs and their '+' variants.

exp(xᵀy) = Π_l Σ_k p_k (x_l y_l)^k / (p_k k!) = E_ω[Π_l X_l Π_l Y_l] with ω_l iid from {p_k} and
X_l = x_l^{ω_l} (ω_l! p_{ω_l})^{−½}, so the softmax-kernel features (the paper's Gaussian-kernel maps
times e^{||u||²/2}) are

    Poisson(λ):    f(ω, u) = e^{λd/2} Π_l u_l^{ω_l} λ^{−ω_l/2}
    geometric(p):  f(ω, u) = p^{−d/2} Π_l u_l^{ω_l} (1−p)^{−ω_l/2} (ω_l!)^{−½}

The draw is integer vectors ω ∈ ℕ^d (iid only). Features carry the sign Π_l sgn(u_l)^{ω_l}: they are
positive only for positive inputs. The '+' variants shift both sets by c (c_l below every x_l, y_l),
which makes the shifted inputs positive; since x̂ᵀŷ = xᵀy − cᵀx − cᵀy + ||c||², each map gains the
factor e^{cᵀu − ||c||²/2}. c_l = min over both sets − ε, ε the '+' variants' option shift_eps
(default SHIFT_EPS = 1e-2; CRT §9.10.2 uses 1e-8).

Parameters: λ* = (mean_{ij} Σ_l x_il² y_jl² / d)^½ (Thm 3.4, statistics by eq. 12) is the exact
minimiser of the mean log second moment. Geometric p minimises CRT's surrogate, eq. 13 at the
averaged |x_l y_l| of eq. 14 (O(L·d)), by Brent's method (scipy's bounded minimize_scalar).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import optimize, special

from favor.kernels import stats
from favor.kernels.base import SymmetricMechanism, check_num_features, check_rows, check_sets, pytree_dataclass, static

SHIFT_EPS = 1e-2   # the ε of CRT §3.2.3: c_l = min over both sets of the l-th coordinate − ε
# (the default of the '+' variants' shift_eps option; CRT §9.10.2 uses 1e-8 in its classification)
P_BOUNDS = (1e-6, 1.0 - 1e-6)


@pytree_dataclass
class DiscreteParams:
    rate: jax.Array    # [...] Poisson λ or geometric p
    shift: jax.Array   # [..., d] c (zeros for the unshifted mechanisms)
    dim: int = static(0)


@pytree_dataclass
class IntegerDraw:
    omega: jax.Array   # [..., M, d] non-negative integers stored as float32 (they enter matmuls)


def _log_bessel_i0(t):
    return np.log(special.i0e(t)) + np.abs(t)


def geometric_surrogate(p, z, d):
    """CRT eq. 13's log second moment (softmax form) at the averaged |x_l y_l| = z_l."""
    return -d * np.log(p) + np.sum(_log_bessel_i0(2.0 * z / np.sqrt(1.0 - p)), axis=-1)


def _brent_p(z):
    z = np.asarray(z, np.float64)
    flat = z.reshape(-1, z.shape[-1])
    d = z.shape[-1]
    out = np.empty(flat.shape[0], np.float32)
    for i, zi in enumerate(flat):
        res = optimize.minimize_scalar(geometric_surrogate, bounds=P_BOUNDS, args=(zi, d),
                                       method="bounded", options={"xatol": 1e-10, "maxiter": 200})
        out[i] = res.x
    return out.reshape(z.shape[:-1])


def fit_geometric_p(z):
    """Brent minimisation of the surrogate for every leading index; works under jit via a callback."""
    z = jnp.asarray(z, jnp.float32)
    return jax.pure_callback(_brent_p, jax.ShapeDtypeStruct(z.shape[:-1], jnp.float32), z,
                             vmap_method="sequential")


class Discrete(SymmetricMechanism):
    positive = False
    OPTIONS = {}
    shifted = False

    def __init__(self, **options):
        self.options = options

    # -- fit -------------------------------------------------------------------------------------
    def fit(self, x, y, x_mask=None, y_mask=None):
        x, y = check_sets(x, y, x_mask, y_mask)
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        d = x.shape[-1]
        bs = jnp.broadcast_shapes(x.shape[:-2], y.shape[:-2])
        shift = jnp.zeros((*bs, d), jnp.float32)
        if self.shifted:
            big = jnp.finfo(jnp.float32).max
            lo_x = jnp.min(jnp.where(_valid(x_mask, x)[..., None], x, big), axis=-2)
            lo_y = jnp.min(jnp.where(_valid(y_mask, y)[..., None], y, big), axis=-2)
            lo = jnp.minimum(lo_x, lo_y)
            shift = jnp.where(lo < big, lo - self.shift_eps, 0.0) + shift
            x, y = x - shift[..., None, :], y - shift[..., None, :]
        wx, wy = stats.row_weights(x, x_mask), stats.row_weights(y, y_mask)
        return DiscreteParams(rate=self._fit_rate(x, wx, y, wy), shift=shift, dim=d)

    # -- draw ------------------------------------------------------------------------------------
    def draw(self, key, num_features, params, coupling="iid"):
        check_num_features(num_features)
        if coupling != "iid":
            raise ValueError(f"{self.name}: integer draws are iid only; got coupling={coupling!r}")
        shape = (*params.rate.shape, num_features, params.dim)
        return IntegerDraw(omega=self._sample(key, params.rate[..., None, None], shape).astype(jnp.float32))

    # -- features --------------------------------------------------------------------------------
    def log_features(self, u, w, params):
        u = check_rows(u, params.dim, f"{self.name} features").astype(jnp.float32)
        c = params.shift[..., None, :]
        log_shift = jnp.sum(c * u, -1, keepdims=True) - 0.5 * jnp.sum(c * c, -1, keepdims=True)
        u = u - c
        omega = w.omega
        tiny = jnp.finfo(jnp.float32).tiny
        # u_l^0 = 1 even at u_l = 0: log|u| is clipped, so 0·log(tiny) = 0 there
        proj = jnp.log(jnp.maximum(jnp.abs(u), tiny)) @ jnp.swapaxes(omega, -1, -2)
        odd = jnp.mod(omega, 2.0)
        neg = (u < 0).astype(jnp.float32) @ jnp.swapaxes(odd, -1, -2)
        sign = 1.0 - 2.0 * jnp.mod(neg, 2.0)
        log_abs = proj + self._log_const(omega, params)[..., None, :] + log_shift \
            - 0.5 * math.log(omega.shape[-2])
        return log_abs, sign

    # -- analysis --------------------------------------------------------------------------------
    def log_second_moment(self, x, y, params):
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        c = params.shift[..., None, :]
        shift_term = (2.0 * jnp.sum(c * x, -1) - jnp.sum(c * c, -1))[..., :, None] + \
                     (2.0 * jnp.sum(c * y, -1) - jnp.sum(c * c, -1))[..., None, :]
        xh, yh = x - c, y - c
        prod2 = xh[..., :, None, :] ** 2 * yh[..., None, :, :] ** 2   # [..., Lx, Ly, d]
        return shift_term + self._log_second_unshifted(prod2, params)


def _valid(mask, u):
    return jnp.ones(u.shape[:-1], bool) if mask is None else jnp.asarray(mask, bool)


class Poisson(Discrete):
    name = "poisson"

    def _fit_rate(self, x, wx, y, wy):
        d = x.shape[-1]
        s = jnp.sum(jnp.einsum("...l,...ld->...d", wx, x * x) * jnp.einsum("...l,...ld->...d", wy, y * y), -1)
        return jnp.maximum(jnp.sqrt(s / d), 1e-6)

    def _sample(self, key, rate, shape):
        return jax.random.poisson(key, rate, shape)

    def _log_const(self, omega, params):
        lam = params.rate[..., None]
        return 0.5 * lam * params.dim - 0.5 * jnp.log(lam) * jnp.sum(omega, -1)

    def _log_second_unshifted(self, prod2, params):
        """Thm 3.4 (softmax form): log E[f_x² f_y²] = λd + λ⁻¹ Σ_l x_l² y_l²."""
        lam = params.rate[..., None, None]
        return lam * params.dim + jnp.sum(prod2, -1) / lam


class Geometric(Discrete):
    name = "geometric"

    def _fit_rate(self, x, wx, y, wy):
        z = jnp.einsum("...l,...ld->...d", wx, jnp.abs(x)) * jnp.einsum("...l,...ld->...d", wy, jnp.abs(y))
        return fit_geometric_p(z)

    def _sample(self, key, rate, shape):
        return jax.random.geometric(key, rate, shape) - 1   # jax counts trials (≥ 1); p_k = p(1−p)^k

    def _log_const(self, omega, params):
        p = params.rate[..., None]
        return (-0.5 * params.dim * jnp.log(p) - 0.5 * jnp.log1p(-p) * jnp.sum(omega, -1)
                - 0.5 * jnp.sum(jax.scipy.special.gammaln(omega + 1.0), -1))

    def _log_second_unshifted(self, prod2, params):
        """Thm 3.5 (softmax form): log E[f_x² f_y²] = −d log p + Σ_l log I₀(2(1−p)^{−½}|x_l y_l|)."""
        p = params.rate[..., None, None]
        t = 2.0 * jnp.sqrt(prod2) / jnp.sqrt(1.0 - p)[..., None]
        return -params.dim * jnp.log(p) + jnp.sum(jnp.log(jax.scipy.special.i0e(t)) + t, -1)


class _Shifted:
    """The '+' variants: option shift_eps, the ε of c_l = min_l − ε (default SHIFT_EPS)."""
    shifted = True
    OPTIONS = {"shift_eps": SHIFT_EPS}

    def __init__(self, **options):
        super().__init__(**options)
        eps = options.get("shift_eps", SHIFT_EPS)
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0):
            raise ValueError(f"{self.name}: shift_eps must be a positive number; got {eps!r}")
        self.shift_eps = float(eps)


class PoissonPlus(_Shifted, Poisson):
    name = "poisson+"


class GeometricPlus(_Shifted, Geometric):
    name = "geometric+"
