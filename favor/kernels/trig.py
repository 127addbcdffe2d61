"""Trigonometric random features (FAVOR; Rahimi & Recht), the softmax-kernel form.

φ(u) = exp(||u||²/2)/√M · [sin(ω_mᵀu), cos(ω_mᵀu)]_m, the same map for queries and keys: 2M features,
not positive, so callers (the attention normaliser) must guard the sign of the denominator.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from favor.kernels.base import (SymmetricMechanism, check_num_features, check_rows, check_sets, pytree_dataclass, static)
from favor.kernels.couplings import check_coupling, draw as draw_projections
from favor.kernels.sincos import sin_cos_features


@pytree_dataclass
class NoParams:
    """Data-independent mechanisms carry only the dimension."""
    dim: int = static(0)


class Trig(SymmetricMechanism):
    name = "trig"
    positive = False
    data_dependent = False
    OPTIONS = {}

    def __init__(self, **options):
        self.options = options

    def fit(self, x, y, x_mask=None, y_mask=None):
        x, _ = check_sets(x, y, x_mask, y_mask)
        return NoParams(dim=x.shape[-1])

    def draw(self, key, num_features, params, coupling="iid"):
        return self.draw_base(key, num_features, params.dim, coupling)

    def draw_base(self, key, num_features, dim, coupling="iid"):
        check_num_features(num_features)
        return draw_projections(key, num_features, dim, check_coupling(coupling))

    def feature_dim(self, num_features):
        return 2 * num_features

    def log_features(self, u, w, params):
        """(log-scale [..., L, 1], values [..., L, 2M]): φ = e^scale · [sin, cos]. Only the norm factor
        needs log space; the bounded sin/cos stay as they are (no log|sin| and exp back: the attention
        layer exponentiates one scalar per row)."""
        u = check_rows(u, params.dim, "trig features").astype(jnp.float32)
        proj = u @ jnp.swapaxes(w.omega, -1, -2)
        trig = sin_cos_features(proj)
        scale = 0.5 * jnp.sum(u * u, -1, keepdims=True) - 0.5 * math.log(w.omega.shape[-2])
        return scale, trig

    def log_second_moment(self, x, y, params):
        """One frequency's estimate is e^{(||x||²+||y||²)/2} cos(ωᵀ(x − y)); E cos² = (1 + e^{−2||Δ||²})/2."""
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        sq_x = jnp.sum(x * x, -1)[..., :, None]
        sq_y = jnp.sum(y * y, -1)[..., None, :]
        delta2 = sq_x + sq_y - 2.0 * x @ jnp.swapaxes(y, -1, -2)
        return sq_x + sq_y + jnp.log1p(jnp.exp(-2.0 * delta2)) - math.log(2.0)

    def variance(self, x, y, params, num_features, coupling="iid"):
        """MATH.md / HRF Lemma 2.2: (1/2M)·e^{||x||²+||y||²}·(1 − e^{−||x−y||²})² for M frequencies."""
        num_features = check_num_features(num_features)
        if coupling != "iid":
            raise ValueError(f"trig: the analytic variance is for coupling='iid' only; got {coupling!r}")
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        sq_x = jnp.sum(x * x, -1)[..., :, None]
        sq_y = jnp.sum(y * y, -1)[..., None, :]
        delta2 = sq_x + sq_y - 2.0 * x @ jnp.swapaxes(y, -1, -2)
        return jnp.exp(sq_x + sq_y) * jnp.expm1(-delta2) ** 2 / (2.0 * num_features)
