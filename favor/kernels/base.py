"""What every random-feature mechanism of the softmax kernel SM(x, y) = exp(xᵀy) provides.

A mechanism turns two sets of vectors into features whose inner product estimates SM:

    params = mech.fit(x, y)                     # data-dependent parameters, closed form
    # = mech.fit_statistics(mech.statistics(x, y)): the fit sees the data only through its
    # sufficient statistics, so they can be pooled, averaged over training steps (causal attention
    # keeps running statistics, as BatchNorm does) or taken from a prefix
    w = mech.draw(key, num_features, params)    # the random draw (projections, integers, ...)
    fx = mech.query_features(x, w, params)      # [..., Lx, F]
    fy = mech.key_features(y, w, params)        # [..., Ly, F]
    fx @ fy.T                                   # unbiased estimate of exp(x @ y.T)

Features are computed in log space: `*_log_features` return (log-part, multiplier) with
f = exp(log-part) · multiplier. Either the log-part is log|f| [..., L, F] and the multiplier a sign (None
for mechanisms whose features are positive), or, for maps whose only unbounded factor is per row
(trig's e^{||u||²/2}, HRF), the log-part is a per-row log-scale [..., L, 1] and the multiplier holds the
bounded feature values (|value| ≤ 1). The attention layer subtracts its stabilisers from the log-part
before exponentiating (one exp per row in the second form); the plain `*_features` methods
exponentiate directly.

Shapes: x [..., Lx, d], y [..., Ly, d]; leading dimensions (batch, heads) broadcast through
fit, draw and the feature maps. Masks are [..., L] booleans (True = a real row).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def pytree_dataclass(cls):
    """A frozen dataclass registered as a pytree; fields with metadata static=True are static."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    data, meta = [], []
    for f in dataclasses.fields(cls):
        (meta if f.metadata.get("static", False) else data).append(f.name)
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static(default=dataclasses.MISSING):
    return dataclasses.field(default=default, metadata={"static": True})


def combine(log_abs: jax.Array, sign: jax.Array | None) -> jax.Array:
    """Features from their log-space form."""
    f = jnp.exp(log_abs)
    return f if sign is None else sign * f


def log_abs_sign(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log|v|, sign v) for sign-indefinite features. |v| is clamped at the smallest normal float,
    not offset by it: an offset below it flushes to zero on CPUs, and log(0)'s infinite derivative
    then turns exact zeros (sin 0 for an all-zero query) into NaN gradients."""
    return jnp.log(jnp.maximum(jnp.abs(v), jnp.finfo(v.dtype).tiny)), jnp.sign(v)


def check_sets(x, y, x_mask=None, y_mask=None, where="fit"):
    """Shape checks shared by every mechanism: clear errors naming the bad shape."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.ndim < 2 or y.ndim < 2:
        raise ValueError(f"{where}: x and y must be [..., L, d]; got shapes {x.shape} and {y.shape}")
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"{where}: x and y must share the last dimension d; got {x.shape} and {y.shape}")
    for name, m, a in (("x_mask", x_mask, x), ("y_mask", y_mask, y)):
        if m is not None and tuple(jnp.shape(m)) != tuple(a.shape[:-1]):
            raise ValueError(f"{where}: {name} must have shape {a.shape[:-1]} (the rows of its set); "
                             f"got {jnp.shape(m)}")
    return x, y


def check_rows(u, dim, where):
    u = jnp.asarray(u)
    if u.ndim < 2 or u.shape[-1] != dim:
        raise ValueError(f"{where}: expected rows [..., L, {dim}]; got shape {u.shape}")
    return u


def check_num_features(num_features):
    if not isinstance(num_features, (int, np.integer)) or num_features < 1:
        raise ValueError(f"num_features must be a positive integer; got {num_features!r}")
    return int(num_features)


def log_variance_from_moments(log_second: jax.Array, log_mean: jax.Array) -> jax.Array:
    """log(E[Z²] − E[Z]²) from log E[Z²] and log E[Z], stable when the two are close or huge."""
    gap = jnp.minimum(2.0 * log_mean - log_second, 0.0)
    return log_second + jnp.log(-jnp.expm1(gap) + 1e-38)


class Mechanism(abc.ABC):
    """One random-feature estimator of SM(x, y). Subclasses set `name` and `positive`."""

    name: str = ""
    positive: bool = True   # features always > 0: the attention normaliser needs no sign guard
    data_dependent: bool = True   # fit depends on the data (False: only on the dimension)
    options: dict[str, Any]

    # ---- data-dependent parameters -------------------------------------------------------
    @abc.abstractmethod
    def fit(self, x, y, x_mask=None, y_mask=None):
        """Closed-form parameters from the sets x [..., Lx, d] and y [..., Ly, d]."""

    def statistics(self, x, y, x_mask=None, y_mask=None, init=None):
        """The sufficient statistics `fit` uses, per leading index ([..., ...]); `init` a previous
        value where the statistic is found iteratively (cluster centres)."""
        raise TypeError(f"{self.name!r}: its fit has no sufficient statistics (data_dependent="
                        f"{self.data_dependent}); call fit(x, y) directly")

    def fit_statistics(self, stats):
        """The parameters `fit` would give on data with these statistics."""
        raise TypeError(f"{self.name!r}: its fit has no sufficient statistics; call fit(x, y) directly")

    # ---- the random draw -----------------------------------------------------------------
    @abc.abstractmethod
    def draw(self, key, num_features, params, coupling="iid"):
        """The mechanism's random draw for `num_features` random features."""

    def draw_base(self, key, num_features, dim, coupling="iid"):
        """The part of a draw that depends on nothing but the key, e.g. the coupled Gaussian ω.
        Models store it as state (so eval is deterministic and a checkpoint holds it) and turn it
        into the call's draw with `adapt_draw`. Mechanisms whose draw depends on the data (Poisson
        and geometric degrees) have none."""
        raise NotImplementedError(f"{self.name}: the draw depends on the fitted parameters; "
                                  f"draw it per call with draw(key, num_features, params)")

    def adapt_draw(self, base, params):
        """The call's draw from a stored `draw_base` and this call's fitted parameters."""
        return base

    def feature_dim(self, num_features: int) -> int:
        """Width F of the feature vectors produced from a draw of `num_features`."""
        return num_features

    def draws_for_width(self, width: int) -> int:
        """The largest `num_features` (this mechanism's own count: projections, frequencies, HRF's m)
        whose features are at most `width` wide: how attention spends one feature budget on every kind.
        A width too small for one draw is a ValueError naming the least width."""
        per = self.feature_dim(1)                     # every feature_dim is linear in its count
        if per * 2 != self.feature_dim(2):
            raise TypeError(f"{self.name}: feature_dim is not linear in num_features")
        if width < per:
            raise ValueError(f"{self.name}: a feature width of {width} is below one draw of this mechanism, "
                             f"which makes {per} features; num_features must be ≥ {per}")
        return width // per

    # ---- feature maps ----------------------------------------------------------------------
    @abc.abstractmethod
    def query_log_features(self, x, w, params):
        """(log|φ_q(x)|, sign or None), each [..., Lx, F]."""

    @abc.abstractmethod
    def key_log_features(self, y, w, params):
        """(log|φ_k(y)|, sign or None), each [..., Ly, F]."""

    def query_features(self, x, w, params):
        return combine(*self.query_log_features(x, w, params))

    def key_features(self, y, w, params):
        return combine(*self.key_log_features(y, w, params))

    def estimate(self, x, y, w, params):
        """The estimate φ_q(x)ᵀφ_k(y) of exp(x @ yᵀ) for every pair: [..., Lx, Ly]."""
        fx, fy = self.query_features(x, w, params), self.key_features(y, w, params)
        return fx @ jnp.swapaxes(fy, -1, -2)

    # ---- analysis ----------------------------------------------------------------------------
    def log_second_moment(self, x, y, params):
        """log E[(f_q(ω, x) f_k(ω, y))²] of one sample, every pair: [..., Lx, Ly]."""
        raise TypeError(f"{self.name!r} has no per-sample second moment (its estimate is not a mean of "
                        "iid samples); use variance(...)")

    def log_variance(self, x, y, params):
        """log of the per-sample variance (one random feature, iid), every pair."""
        x, y = jnp.asarray(x), jnp.asarray(y)
        log_mean = x @ jnp.swapaxes(y, -1, -2)
        return log_variance_from_moments(self.log_second_moment(x, y, params), log_mean)

    def variance(self, x, y, params, num_features, coupling="iid"):
        """Analytic variance of the estimate from `num_features` iid features, every pair."""
        num_features = check_num_features(num_features)
        if coupling != "iid":
            raise ValueError(f"{self.name!r}: the analytic variance is for coupling='iid' only; "
                             f"got coupling={coupling!r}")
        return jnp.exp(self.log_variance(x, y, params)) / num_features

    def objective(self, x, y, params, x_mask=None, y_mask=None):
        """The shifted log-variance objective: mean over valid pairs of log E[(f_q f_k)²].

        Every data-dependent mechanism's fit minimises this (FAVOR# §3); tests perturb the
        fitted parameters and check that it never goes down.
        """
        lsm = self.log_second_moment(x, y, params)
        wx = jnp.ones(x.shape[:-1]) if x_mask is None else jnp.asarray(x_mask, jnp.float32)
        wy = jnp.ones(y.shape[:-1]) if y_mask is None else jnp.asarray(y_mask, jnp.float32)
        w = wx[..., :, None] * wy[..., None, :]
        return jnp.sum(w * lsm, axis=(-1, -2)) / jnp.sum(w, axis=(-1, -2))

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({self.name!r}{', ' if opts else ''}{opts})"


def average_statistics(running, new, momentum):
    """Running statistics as BatchNorm keeps them: momentum·running + (1 − momentum)·new, where both
    have seen data; `new` alone the first time (count 0) and `running` alone where `new` saw nothing.
    Every statistics pytree carries `count` (valid rows seen, per leading index)."""
    fresh = running.count <= 0
    empty = new.count <= 0

    def mix(r, n):
        shape = fresh.shape + (1,) * (r.ndim - fresh.ndim)
        blend = momentum * r + (1.0 - momentum) * n
        out = jnp.where(fresh.reshape(shape), n, blend)
        return jnp.where(empty.reshape(shape), r, out)

    out = jax.tree.map(mix, running, new)
    return dataclasses.replace(out, count=running.count + new.count)


class SymmetricMechanism(Mechanism):
    """A mechanism whose query and key maps are the same function (φ_q = φ_k)."""

    @abc.abstractmethod
    def log_features(self, u, w, params):
        """(log|φ(u)|, sign or None), [..., L, F]."""

    def query_log_features(self, x, w, params):
        return self.log_features(x, w, params)

    def key_log_features(self, y, w, params):
        return self.log_features(y, w, params)
