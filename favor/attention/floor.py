"""The ratio every linear pass ends with, and the floor of the sign-indefinite kinds (trig, HRF): their
estimated denominator can fall near zero or below it, so a row whose estimate is below the bound the
true denominator cannot go below (Jensen: n_i·exp(x_iᵀȳ_i), `jensen_floor`) is raised to that bound,
with the values' mean as its anchor (`floored_ratio`). Inputs as favor.attention.linear describes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from favor.kernels.base import pytree_dataclass
from favor.attention.linear import (F32, NEG_INF, NO_RUN, _divide, cumulative, cumulative_sum, guard, segmented,
                                   segmented_all, sg)

# The least bound, on a row's own scale, that floored_ratio divides by: every stabilised term is ≤ 1, so
# the numerator is below L·F·max|v| and its quotient stays finite in float32 (an inf there would turn a
# zero cotangent into NaN in the backward pass)
MIN_BOUND = math.exp(-40.0)


def ratio(out, positive, scale=None, floor=None):
    """out [.., Dv+1] (numerator and denominator on the row's log-scale `scale` [..]) -> [.., Dv].
    `floor` (a `Floor`, sign-indefinite kinds): a denominator estimated below the bound the true one
    cannot go below is raised to it (`floored_ratio`)."""
    if floor is not None:
        return floored_ratio(out, positive, scale, floor)
    return divide(out[..., :-1], out[..., -1], positive)


def divide(num, den, positive):
    """num [.., Dv] / den [..] for a pass that keeps them apart (no floor): `ratio`'s plain case."""
    return _divide(num, guard(den, positive))


@pytree_dataclass
class Floor:
    """What a sign-indefinite kind's ratio needs about the keys each query sees (`jensen_floor`):
    log [B, H, Lq] the log of the bound n_i·exp(x_iᵀȳ_i) on the true denominator, and the mean, minimum
    and maximum of the values those keys carry, [B, H, Lq | 1, Dv]; log_mass [B, H, Lq] (or None) the log
    of a bound on ‖φ_q(i)‖·Σ_j ‖φ_k(j)‖ over the keys query i sees (`log_norm_bounds`), by Cauchy–Schwarz
    a bound on the absolute mass Σ_j Σ_f |φ_q(i, f)φ_k(j, f)| the estimate sums, and with it on the
    float32 rounding of that row's sums (`floored_ratio`)."""
    log: jax.Array
    mean: jax.Array
    low: jax.Array
    high: jax.Array
    log_mass: jax.Array | None = None


def jensen_floor(x, y, v, valid=None, causal=False, norms=None, runs=None, gap=0) -> Floor:
    """The denominator's floor for every query: x [B, H, Lq, D], y [B, H, Lk, D] the kernel's inputs,
    v [B, H, Lk, Dv], valid [B, Lk] or None; causal: queries aligned to the last keys, each seeing the
    keys up to its own position; norms: (log‖φ_q‖ [B, H, Lq], log‖φ_k‖ [B, H, Lk]) (`log_norm_bounds`) for
    the rounding bound's mass (`Floor.log_mass`), or None for a floor without it (diagnostics that only
    compare denominators with the bound); runs [B, Lk]: packed documents (favor.attention.documents),
    each query's keys those of its own document (x and y of one length). gap > 0 (a window's band of
    w = gap − 1): the mass counts the keys the estimate sums only, |i − j| ≥ gap — the band's exact
    weights add to the denominator the bound bounds but carry no estimate's rounding.

    By Jensen (exp is convex), Σ_j exp(x_iᵀy_j) ≥ n_i·exp(x_iᵀȳ_i), ȳ_i the mean of the n_i keys query
    i sees: O(L·D), causal through prefix sums, and never looser than the norm bound
    n_i·e^(−‖x_i‖·max‖y_j‖) (since x_iᵀȳ_i ≥ −‖x_i‖‖ȳ_i‖). log is −inf for a query that sees no key."""
    x, y, v = x.astype(F32), y.astype(F32), v.astype(F32)
    l_q, l_k = x.shape[2], y.shape[2]
    w = jnp.ones((1, 1, l_k, 1), F32) if valid is None else jnp.asarray(valid, F32)[:, None, :, None]
    ones = jnp.broadcast_to(w, (w.shape[0], 1, l_k, 1))
    big = jnp.finfo(F32).max
    v_lo, v_hi = jnp.where(w > 0, v, big), jnp.where(w > 0, v, -big)
    if runs is not None:
        return _document_floor(x, y, v, w, causal, norms, runs, gap)
    if causal:
        rows = lambda a: a[:, :, l_k - l_q:]
        ysum, vsum, count = (rows(cumulative_sum(a)) for a in (y * w, v * w, ones))
        low, high = rows(jax.lax.cummin(v_lo, axis=2)), rows(jax.lax.cummax(v_hi, axis=2))
    else:
        ysum, vsum, count = (jnp.sum(a, axis=2, keepdims=True) for a in (y * w, v * w, ones))
        low, high = jnp.min(v_lo, axis=2, keepdims=True), jnp.max(v_hi, axis=2, keepdims=True)
    n = jnp.maximum(count, 1.0)                                                # [B, 1, Lq | 1, 1]
    log = jnp.log(n[..., 0]) + jnp.einsum("bhld,bhld->bhl", x, jnp.broadcast_to(ysum, x.shape)) / n[..., 0]
    mass = None
    if norms is not None:
        nq, nk = (sg(a.astype(F32)) for a in norms)
        if valid is not None:
            nk = jnp.where(jnp.asarray(valid, bool)[:, None, :], nk, NEG_INF)
        if gap:
            nk = estimated_mass(nk, causal, None, gap)[:, :, l_k - l_q:]
        else:
            nk = rows(cumulative(nk, jnp.logaddexp, NEG_INF)) if causal else jax.nn.logsumexp(nk, axis=2, keepdims=True)
        mass = jnp.where(count[..., 0] > 0, nq + nk, NEG_INF)
    return Floor(log=jnp.where(count[..., 0] > 0, log, NEG_INF), mean=vsum / n, low=low, high=high,
                 log_mass=mass)


def estimated_mass(nk, causal, runs=None, gap=1):
    """log Σ_j ‖φ_k(j)‖ [B, H, L] over the keys an estimate with a band sums for query i: j ≤ i − gap, and
    j ≥ i + gap when bidirectional, of i's document when `runs` are given; nk [B, H, L] (−inf: no key)."""
    def before(nk, r):
        total = cumulative(nk, jnp.logaddexp, NEG_INF) if r is None else segmented(
            nk, r[:, None], jnp.logaddexp, NEG_INF)
        l = nk.shape[2]
        moved = jnp.pad(total, ((0, 0), (0, 0), (gap, 0)), constant_values=NEG_INF)[:, :, :l]
        if r is None:
            return moved
        same = jnp.pad(r, ((0, 0), (gap, 0)), constant_values=NO_RUN)[:, :l] == r
        return jnp.where(same[:, None], moved, NEG_INF)

    out = before(nk, runs)
    if not causal:
        flip = lambda a: None if a is None else jnp.flip(a, axis=-1)
        out = jnp.logaddexp(out, flip(before(flip(nk), flip(runs))))
    return out


def _document_floor(x, y, v, w, causal, norms, runs, gap=0):
    """jensen_floor over packed documents: the sums, extremes and counts per document, running (causal)
    or the document's whole (a running reduction restarting at each document, read at its last token)."""
    nq = nk = None
    if norms is not None:
        nq, nk = (sg(a.astype(F32)) for a in norms)
        nk = jnp.where(w[..., 0] > 0, nk, NEG_INF)
    stats = document_stats(y, v, w, runs, None if gap else nk)
    if not causal:
        stats = {name: whole_document(a, runs) for name, a in stats.items()}
    drop = y.shape[2] - x.shape[2]               # causal queries aligned to the last keys
    stats = {name: a[:, :, drop:] for name, a in stats.items()}
    if norms is not None and gap:
        stats["mass"] = estimated_mass(nk, causal, runs, gap)[:, :, drop:]
    return floor_of(x, stats, nq)


# The reductions `document_stats` keeps and how two parts of a document combine: (operation, identity)
_BIG = float(jnp.finfo(F32).max)
STAT_OPS = {"y": (jnp.add, 0.0), "v": (jnp.add, 0.0), "n": (jnp.add, 0.0), "low": (jnp.minimum, _BIG),
            "high": (jnp.maximum, -_BIG), "mass": (jnp.logaddexp, NEG_INF)}


def document_stats(y, v, w, runs, nk=None):
    """What the floor reads of the keys of each token's document up to it (a running reduction restarting
    at each document): key sum "y" [B, H, L, D], value sum "v" and extremes "low"/"high" [B, H, L, Dv],
    count "n" [B, 1, L, 1] and, with nk [B, H, L] (log‖φ_k‖, −inf for no key), "mass" log Σ‖φ_k‖ [B, H, L].
    w [B, 1, L, 1] the keys' 0/1 mask. Parts of one document combine under STAT_OPS (the sequence axis
    carries them across devices)."""
    ones = jnp.broadcast_to(w, (w.shape[0], 1, w.shape[2], 1))
    parts = {"y": y * w, "v": v * w, "n": ones, "low": jnp.where(w > 0, v, _BIG), "high": jnp.where(w > 0, v, -_BIG)}
    if nk is not None:
        parts["mass"] = nk
    return segmented_all(parts, runs[:, None, :, None], {name: STAT_OPS[name][0] for name in parts}, axis=2)


def whole_document(a, runs):
    """A running reduction [B, ., L, ...] (`document_stats`) read at each token's document's last token:
    the document's whole."""
    b, l = runs.shape
    ends = jnp.flip(segmented(jnp.flip(jnp.broadcast_to(jnp.arange(l)[None], (b, l)), 1), jnp.flip(runs, 1),
                              jnp.maximum, -1), 1)[:, None, :]                # each token's document's end
    return jnp.take_along_axis(a, ends[..., None] if a.ndim == 4 else ends, axis=2)


def floor_of(x, stats, nq=None):
    """The Floor of queries x [B, H, Lq, D] from the reductions over the keys each sees (`document_stats`'
    names, aligned to the queries); nq [B, H, Lq] log‖φ_q‖ with stats["mass"] for the rounding bound."""
    count = stats["n"]
    n = jnp.maximum(count, 1.0)
    log = jnp.log(n[..., 0]) + jnp.einsum("bhld,bhld->bhl", x, jnp.broadcast_to(stats["y"], x.shape)) / n[..., 0]
    mass = None if nq is None else jnp.where(count[..., 0] > 0, nq + stats["mass"], NEG_INF)
    return Floor(log=jnp.where(count[..., 0] > 0, log, NEG_INF), mean=stats["v"] / n, low=stats["low"],
                 high=stats["high"], log_mass=mass)


# float32's unit roundoff: the residual below is two float32 sums (the numerator and the denominator
# times the mean), each off by about this times the absolute mass it sums (`Floor.log_mass` bounds that
# mass from above; the rounding measured with identical keys sat 1e3 to 1e4 times below this bound)
RESIDUAL_ROUNDING = 2.0 ** -24


def log_norm_bounds(l, s):
    """An upper bound on log‖φ‖ per row [.., L] of features in log space (l, s as the passes take them:
    log|φ| and a sign or None, or a per-row log-scale and values |·| ≤ 1): ‖φ‖ ≤ √F·e^(max_f l). It
    reads the log-part only, so where the map is traced for it alone XLA drops the values (trig's and
    HRF's sin and cos: the whole-array map would cost as much as the pass's own)."""
    width = l.shape[-1] if s is None else s.shape[-1]
    return 0.5 * math.log(width) + jnp.max(l.astype(F32), axis=-1)


def floored_ratio(out, positive, scale, floor):
    """The ratio of a sign-indefinite estimate (trig, HRF) whose denominator may fall below the bound
    exp(floor.log) that the true one, a sum of positive kernel values, can never go below. Such a row
    (`out` on the log-scale `scale`) is computed as

        y_i = v̄_i + Σ_j ŵ_ij (v_j − v̄_i) / b_i,     b_i the bound, v̄_i the mean of the values it sees,

    i.e. the denominator is raised to the bound and the mass it lacked carries the mean value (uniform
    weights, the weights of the bound itself), then kept inside the values' range [min v_j, max v_j]
    where every attention output lies. So a clamped row is never sign-flipped nor blown up by a
    denominator near 0, identical keys still give the mean of their values and a lone key its own value;
    the estimate is biased there (it only ever moves towards the truth's side of the bound). Rows whose
    estimate is at or above the bound are bit-for-bit the plain ratio. A bound below MIN_BOUND on the
    row's scale counts as MIN_BOUND (such a row's estimate is noise e^40 times the size of its bound:
    its output sits at the range's edge, finite, with finite gradients).

    The residual r_i = Σ_j ŵ_ij (v_j − v̄_i) is formed in float32 as num − den·v̄ from sums whose terms
    cancel: its rounding is up to u_i = RESIDUAL_ROUNDING·M_i·(max|v| + |v̄_i|), M_i the absolute mass
    the row sums (`Floor.log_mass` bounds it), and dividing by a bound far below that mass magnifies it
    (identical keys at ‖x‖, ‖y‖ ≈ 2·√D: r is 0 in exact arithmetic, its rounding over b_i reached 3 in
    the outputs). So r is shrunk towards 0 by u_i (soft thresholding, per value coordinate): the part of
    the residual float32 can resolve is kept, the part it cannot is the uniform weights' (0), and
    identical keys give the mean of their values at any norm."""
    num, den = out[..., :-1], out[..., -1]
    low, bound = _below(out, scale, floor)
    raised = jnp.where(low, jnp.maximum(bound, MIN_BOUND), 1.0)
    residual = num - den[..., None] * floor.mean
    if floor.log_mass is not None:
        # on the row's scale; double where as in _bound (a row without a bound is not low and reads 0)
        ok = jnp.isfinite(floor.log_mass) & jnp.isfinite(scale)
        gap = jnp.where(ok, floor.log_mass - jnp.where(ok, scale, 0.0), 0.0)
        vmax = jnp.maximum(jnp.abs(floor.low), jnp.abs(floor.high)) + jnp.abs(floor.mean)
        u = sg(RESIDUAL_ROUNDING * jnp.exp(jnp.minimum(gap, 80.0))[..., None] * vmax)
        residual = jnp.sign(residual) * jnp.maximum(jnp.abs(residual) - u, 0.0)
    floored = jnp.clip(floor.mean + _divide(residual, raised), floor.low, floor.high)
    # the plain ratio with a floored row's denominator read as 1: that branch is discarded there, and
    # num/den of a denominator far below the numerator would overflow it, turning the row's zero
    # cotangent into NaN
    return jnp.where(low[..., None], floored, _divide(num, guard(jnp.where(low, 1.0, den), positive)))


def below_floor(out, scale, floor):
    """[..]: which rows' estimated denominators fall below the floor, as `floored_ratio` decides: below
    the bound, or ≤ 0 in a row that sees a key (below any positive bound, also one that underflowed on
    the row's scale)."""
    return _below(out, scale, floor)[0]


def _below(out, scale, floor):
    """(rows below the floor, the bound on each row's scale)."""
    ok, bound = _bound(floor, scale)
    den = out[..., -1]
    return ok & ((den < bound) | (den <= 0)), bound


def _bound(floor, scale):
    """(rows that have a bound, the bound on the row's scale; 0 where none). Double where: no inf or NaN
    of a row without a bound (no key, or an overflowed input) reaches the backward pass."""
    ok = jnp.isfinite(floor.log) & jnp.isfinite(scale)
    gap = jnp.where(ok, floor.log - jnp.where(ok, scale, 0.0), 0.0)
    return ok, jnp.where(ok, jnp.exp(jnp.minimum(gap, 80.0)), 0.0)
