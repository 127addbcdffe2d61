"""Attention kinds: exact softmax, ReLU/ELU linear attention, and random-feature attention.

Every kind is called the same way:

    out = attn(q, k, v, mask=None, causal=False, rng=None)   # q [B, Lq, H, D], k/v [B, Lk, H, D(v)]

`mask` is a key-padding mask [B, Lk] (True = real token); padded keys are removed from numerator and
denominator and from every statistic (stabilisers, data-dependent fits).
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp

from favor import kernels
from favor.attention import linear
from favor.kernels.base import pytree_dataclass

REDRAW_HELP = "'step' (fresh ω from rng each call), 'every:N' (fresh ω every N steps) or 'fixed'"


def check_qkv(q, k, v, mask):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects q [B, Lq, H, D], k and v [B, Lk, H, D(v)]; "
                         f"got shapes {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must agree on batch, heads and head dim; got {q.shape} and {k.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on batch, length and heads; got {k.shape} and {v.shape}")
    if mask is not None and tuple(jnp.shape(mask)) != (k.shape[0], k.shape[1]):
        raise ValueError(f"mask is a key-padding mask [B, Lk] = {(k.shape[0], k.shape[1])}; "
                         f"got shape {jnp.shape(mask)}")


def _to_bhld(a):
    return jnp.swapaxes(a, 1, 2)


class Attention:
    """Base: holds the options users passed; subclasses implement __call__."""

    name = ""
    OPTIONS: dict[str, Any] = {}

    def __init__(self, **options):
        self.options = options

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r}, {self.options})"


class Softmax(Attention):
    """Exact softmax attention, the baseline (jax.nn.dot_product_attention)."""

    name = "softmax"

    def __call__(self, q, k, v, mask=None, causal=False, rng=None, step=None, draw=None):
        check_qkv(q, k, v, mask)
        m = None if mask is None else jnp.asarray(mask, bool)[:, None, None, :]
        if causal:
            lq, lk = q.shape[1], k.shape[1]
            tri = jnp.tril(jnp.ones((lq, lk), bool), k=lk - lq)[None, None]
            m = tri if m is None else m & tri
        # dot_product_attention wants one head dim for q, k and v: zero-pad the smaller side
        # (zeros change no score, and the scale stays 1/√D of the real head dim).
        d, dv = q.shape[-1], v.shape[-1]
        pad = lambda a, n: jnp.pad(a, ((0, 0),) * 3 + ((0, n - a.shape[-1]),))
        width = max(d, dv)
        out = jax.nn.dot_product_attention(pad(q, width), pad(k, width), pad(v, width), mask=m,
                                           scale=d ** -0.5)[..., :dv]
        if mask is not None:   # a query with no valid key attends to nothing: 0, not NaN
            out = jnp.where(jnp.any(mask, -1)[:, None, None, None], out, 0.0)
        return out


class FeatureAttention(Attention, abc.ABC):
    """Linear attention over a feature map; subclasses give the features."""

    positive = True
    OPTIONS = {"chunk_size": 128}

    def __init__(self, **options):
        super().__init__(**options)
        self.chunk_size = options.get("chunk_size", 128)
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"{self.name}: chunk_size must be a positive integer; got {self.chunk_size!r}")

    @abc.abstractmethod
    def features(self, q, k, mask, rng, step, draw=None):
        """(fq [B,H,Lq,F], fk [B,H,Lk,F]) with padded keys zeroed."""

    def __call__(self, q, k, v, mask=None, causal=False, rng=None, step=None, draw=None):
        """`draw`: a stored `base_draw` (random-feature kinds) used instead of drawing from rng."""
        check_qkv(q, k, v, mask)
        fq, fk = self.features(q, k, mask, rng, step, draw)
        vv = _to_bhld(v)
        if causal:
            out = linear.causal(fq, fk, vv, self.positive, self.chunk_size)
        else:
            out = linear.bidirectional(fq, fk, vv, self.positive)
        return _to_bhld(out).astype(v.dtype)


class ElementwiseAttention(FeatureAttention):
    """Linear attention with a fixed elementwise feature map φ, the same for queries and keys."""

    @staticmethod
    @abc.abstractmethod
    def phi(u):
        """The feature map, elementwise."""

    def features(self, q, k, mask, rng, step, draw=None):
        fq, fk = self.phi(_to_bhld(q)), self.phi(_to_bhld(k))
        if mask is not None:
            fk = fk * jnp.asarray(mask, fk.dtype)[:, None, :, None]
        return fq, fk


class ReluAttention(ElementwiseAttention):
    """φ(u) = relu(u): the ReLU linear-attention baseline of the GLUE tables."""

    name = "relu"
    phi = staticmethod(jax.nn.relu)


class EluAttention(ElementwiseAttention):
    """φ(u) = elu(u) + 1 (Katharopoulos et al.)."""

    name = "elu"
    phi = staticmethod(lambda u: jax.nn.elu(u) + 1.0)


@pytree_dataclass
class RandomFeatureContext:
    """What one call of random-feature attention fixes: fitted parameters and the draw."""
    params: Any
    draw: Any


def parse_redraw(redraw):
    if redraw in ("step", "fixed"):
        return redraw, 0
    if isinstance(redraw, str) and redraw.startswith("every:"):
        try:
            n = int(redraw.split(":", 1)[1])
        except ValueError:
            n = 0
        if n >= 1:
            return "every", n
    raise ValueError(f"unknown redraw {redraw!r}; valid: {REDRAW_HELP}")


class RandomFeatureAttention(FeatureAttention):
    """Linear attention over a kernel mechanism's random features (FAVOR, FAVOR+, ++, #, HRF, SimRF).

    Queries and keys are scaled by D^(−1/4) so that x_iᵀy_j = q_iᵀk_j/√D; one ω serves both. The
    mechanism is fitted per batch and head in float32 from valid tokens only (under stop_gradient
    unless fit_gradients=True). Stabilisers, both under stop_gradient: a per-query constant over
    features, and one constant over all valid keys per batch and head; each cancels in the ratio.
    """

    OPTIONS = {"num_features": 256, "coupling": "orthogonal", "redraw": "step", "seed": 0,
               "fit_gradients": False, "chunk_size": 128}
    mechanism = ""
    mechanism_options: dict[str, Any] = {}

    def __init__(self, **options):
        super().__init__(**options)
        self.num_features = int(options["num_features"])
        if self.num_features < 1:
            raise ValueError(f"{self.name}: num_features must be ≥ 1; got {options['num_features']!r}")
        self.coupling = kernels.couplings.check_coupling(options["coupling"])
        self.redraw, self.redraw_every = parse_redraw(options["redraw"])
        self.seed = int(options["seed"])
        self.fit_gradients = bool(options["fit_gradients"])
        self.mech = kernels.get(self.mechanism, **self.mechanism_options)
        self.positive = self.mech.positive

    # -- what a call fixes -------------------------------------------------------------------------
    def draw_key(self, rng, step):
        """The key ω is drawn from: evaluation (rng None) and 'fixed' use the seed, deterministic."""
        if self.redraw == "fixed" or rng is None:
            return jax.random.PRNGKey(self.seed)
        if self.redraw == "every":
            if step is None:
                raise ValueError(f"{self.name}: redraw='every:{self.redraw_every}' needs the step number")
            return jax.random.fold_in(rng, jnp.asarray(step) // self.redraw_every)
        return rng

    def scaled(self, q, k):
        s = q.shape[-1] ** -0.25
        return _to_bhld(q).astype(jnp.float32) * s, _to_bhld(k).astype(jnp.float32) * s

    def base_draw(self, key, dim):
        """The data-independent draw for head dim `dim` that a model keeps as state."""
        return self.mech.draw_base(key, self.num_features, dim, self.coupling)

    def context(self, q, k, mask=None, rng=None, step=None, query_mask=None, draw=None) -> RandomFeatureContext:
        """Fit the mechanism on the valid tokens and draw ω (or adapt the stored `draw`)."""
        x, y = self.scaled(q, k)
        if not self.fit_gradients:
            x, y = jax.lax.stop_gradient(x), jax.lax.stop_gradient(y)
        per_head = lambda m, u: None if m is None else jnp.broadcast_to(
            jnp.asarray(m, bool)[:, None, :], u.shape[:-1])
        params = self.mech.fit(x, y, per_head(query_mask, x), per_head(mask, y))
        if draw is None:
            w = self.mech.draw(self.draw_key(rng, step), self.num_features, params, self.coupling)
        else:
            w = self.mech.adapt_draw(draw, params)
        return RandomFeatureContext(params=params, draw=w)

    # -- features ----------------------------------------------------------------------------------
    def stabilised_features(self, q, k, mask, ctx):
        x, y = self.scaled(q, k)
        lq, sq = self.mech.query_log_features(x, ctx.draw, ctx.params)
        lk, sk = self.mech.key_log_features(y, ctx.draw, ctx.params)
        cq = jax.lax.stop_gradient(jnp.max(lq, axis=-1, keepdims=True))
        valid = None if mask is None else jnp.asarray(mask, bool)[:, None, :, None]
        lk_for_max = lk if valid is None else jnp.where(valid, lk, -jnp.inf)
        ck = jnp.max(lk_for_max, axis=(-2, -1), keepdims=True)
        ck = jax.lax.stop_gradient(jnp.where(jnp.isfinite(ck), ck, 0.0))
        fq, fk = jnp.exp(lq - cq), jnp.exp(lk - ck)
        if sq is not None:
            fq, fk = fq * sq, fk * sk
        if valid is not None:
            fk = jnp.where(valid, fk, 0.0)
        return fq, fk

    def features(self, q, k, mask, rng, step, draw=None):
        ctx = self.context(q, k, mask, rng, step, self._query_mask(q, k, mask), draw)
        return self.stabilised_features(q, k, mask, ctx)

    @staticmethod
    def _query_mask(q, k, mask):
        # Self-attention (Lq == Lk): padded positions are padded queries too, keep them out of the fit.
        return mask if mask is not None and q.shape[1] == k.shape[1] else None

    # -- incremental decoding ----------------------------------------------------------------------
    def decode_init(self, batch, heads, dv):
        f = self.mech.feature_dim(self.num_features)
        z = jnp.zeros
        return {"s": z((batch, heads, f, dv), jnp.float32), "z": z((batch, heads, f), jnp.float32),
                "c": jnp.full((batch, heads), -jnp.inf, jnp.float32)}

    def decode_step(self, state, q_t, k_t, v_t, ctx):
        """One token: q_t, k_t [B, 1, H, D], v_t [B, 1, H, Dv] -> (out [B, 1, H, Dv], state).

        The key stabiliser is a running maximum; the state is rescaled when it grows, so the outputs
        equal the full causal pass (whose stabiliser is global) to float tolerance.
        """
        x, y = self.scaled(q_t, k_t)
        lq, sq = self.mech.query_log_features(x, ctx.draw, ctx.params)      # [B,H,1,F]
        lk, sk = self.mech.key_log_features(y, ctx.draw, ctx.params)
        c_new = jnp.maximum(state["c"], jnp.max(lk, axis=(-2, -1)))
        shrink = jnp.where(jnp.isfinite(state["c"]), jnp.exp(state["c"] - c_new), 0.0)
        fk = jnp.exp(lk - c_new[..., None, None])[:, :, 0]
        fq = jnp.exp(lq - jnp.max(lq, -1, keepdims=True))[:, :, 0]
        if sq is not None:
            fq, fk = fq * sq[:, :, 0], fk * sk[:, :, 0]
        v = _to_bhld(v_t)[:, :, 0].astype(jnp.float32)
        s = state["s"] * shrink[..., None, None] + fk[..., :, None] * v[..., None, :]
        z = state["z"] * shrink[..., None] + fk
        num = jnp.einsum("bhf,bhfd->bhd", fq, s)
        den = jnp.einsum("bhf,bhf->bh", fq, z)
        out = num / linear.guard(den, self.positive)[..., None]
        return out[:, None].astype(v_t.dtype), {"s": s, "z": z, "c": c_new}


def _rf_kind(kind_name, mechanism, doc, extra_options=None, mech_options=None):
    extra_options = extra_options or {}

    class Kind(RandomFeatureAttention):
        __doc__ = doc
        name = kind_name
        OPTIONS = {**RandomFeatureAttention.OPTIONS, **extra_options}

        def __init__(self, **options):
            self.mechanism, self.mechanism_options = mech_options(options) if callable(mech_options) \
                else (mechanism, {})
            super().__init__(**options)

    Kind.__name__ = Kind.__qualname__ = "".join(p.capitalize() for p in kind_name.replace("+", "plus")
                                                 .replace("#", "sharp").split("-")) + "Attention"
    return Kind


def _choice(kind, key, value, allowed):
    if value not in allowed:
        raise ValueError(f"{kind}: unknown {key} {value!r}; valid: {', '.join(map(repr, allowed))}")
    return value


Favor = _rf_kind("favor", "trig", "FAVOR: trigonometric random features (not positive).")
FavorPlus = _rf_kind(
    "favor+", "positive", "FAVOR+: positive random features.",
    {"antithetic": False, "importance_sampling": False},
    lambda o: ("positive", {"antithetic": o["antithetic"], "importance_sampling": o["importance_sampling"]}))
FavorPlusPlus = _rf_kind(
    "favor++", "oprf", "FAVOR++: optimal positive random features (OPRF).",
    {"importance_sampling": False},
    lambda o: ("oprf", {"importance_sampling": o["importance_sampling"]}))
FavorSharp = _rf_kind(
    "favor#", "sderf", "FAVOR#: dense-exponential random features (SDERF by default).",
    {"variant": "sderf", "importance_sampling": False},
    lambda o: (_choice("favor#", "variant", o["variant"], ("sderf", "saderf", "aderf")),
               {"importance_sampling": o["importance_sampling"]}))
def _hrf_mechanism(o):
    lam = _choice("hrf", "lambda_", o["lambda_"], ("angular", "gaussian", "cluster"))
    if lam == "cluster":
        return "hrf-cluster", {"query_clusters": o["clusters"], "key_clusters": o["clusters"]}
    return "hrf-" + lam, {"num_lambda_features": o["num_lambda_features"]}


# num_features is m, the frequencies of each base estimator; HRF-A(16, 8) is the paper's setting.
Hrf = _rf_kind(
    "hrf", "hrf-angular", "Hybrid random features (not positive; the denominator's sign is guarded).",
    {"lambda_": "angular", "num_features": 16, "num_lambda_features": 8, "clusters": 2}, _hrf_mechanism)
SimRF = _rf_kind(
    "simrf", "positive", "SimRF: positive or OPRF features on simplex-coupled projections.",
    {"features": "positive", "coupling": "simplex"},
    lambda o: ({"positive": "positive", "oprf": "oprf"}[_choice("simrf", "features", o["features"],
                                                                ("positive", "oprf"))], {}))

KINDS = (Softmax, ReluAttention, EluAttention, Favor, FavorPlus, FavorPlusPlus, FavorSharp, Hrf, SimRF)

