"""Linear attention over log-space features: the O(L) cores every feature kind shares.

Inputs are log-features and multipliers, never exponentiated features: lq [B, H, Lq, F] = log|φ_q|,
lk [B, H, Lk, F] = log|φ_k|, sq / sk their signs (None for positive features); or, for maps whose only
unbounded factor is per row (trig, HRF: favor.kernels.base), lq/lk [B, H, L, 1] log-scales and sq/sk the
bounded feature values (|·| ≤ 1) — every formula below broadcasts over that last axis. Values
v [B, H, Lk, Dv], and `valid` [B, Lk] (True = a real key) or None. A log-feature may be −inf (an
exact zero feature, ReLU's); a key whose every log-feature is −inf carries no mass and counts as no
key. Padded keys are set to −inf here, before anything is exponentiated, so a padded key can change
neither an output nor a gradient.

    Y = diag(Φ_q (Φ_kᵀ 1))⁻¹ Φ_q (Φ_kᵀ V)                      (bidirectional)
    Y_i = φ_q(i)ᵀ Σ_{j≤i} φ_k(j) v_jᵀ / φ_q(i)ᵀ Σ_{j≤i} φ_k(j)    (causal)

Stabilisers. φ = exp(l) can over- or underflow float32 long before the ratio does, so both sides are
shifted before exponentiating, by constants that cancel in the ratio, all under stop_gradient:
- keys by a per-feature constant τ_f (the inverse shift goes to the queries, so φ_qᵀφ_k is unchanged);
- each query by a scalar c_i chosen *knowing the keys*: c_i = max_f(l_q(i, f) + τ_f). With τ_f the
  maximum of l_k(·, f) over the keys the query sees, every shifted factor is ≤ 1 and the shifted
  denominator of a positive kind is ≥ 1 (the term at the maximising feature and key is 1), so no
  relevant term underflows and no floor is needed (a query whose own strongest features do not line
  up with the strongest key is exactly where a per-side maximum fails).
Causal mode keeps every stabiliser causal: the output at position i is computed from keys ≤ i only,
stabilisers included (see `causal_maps`). Sequence sums and carried states accumulate in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from functools import partial

import jax
import jax.numpy as jnp

from favor.kernels.base import pytree_dataclass

F32 = jnp.float32
TINY = float(jnp.finfo(jnp.float32).tiny)
NEG_INF = -jnp.inf
LOWEST_SCALE = -1e30     # a stabiliser's floor: finite, and below any finite log-feature that matters
# The fast causal path is exact while no key exceeds its chunk's reference by more than this (in
# log units); see `_causal_fast`. Lost terms are then below e^(−87 + 40 + log(L·F)) of the
# denominator, under float32's resolution for L·F < e^30.
FAST_EXCEEDANCE = 40.0
EXACT_BLOCK = 16          # block of the exact causal path, whose diagonal blocks are formed in log space
PATHS = ("auto", "fast", "exact")

sg = jax.lax.stop_gradient


def jit_when_eager(*static_argnames):
    """jax.jit for an eager call (compiled once per map and shape, not op by op); inlined as plain code
    when a caller is already tracing. Why not jit always: XLA:CPU fuses a nested jit's body apart from
    its caller, and at short lengths that split costs more than the pass (BENCHMARKS.md,
    short-length-inline)."""
    def wrap(fn):
        jitted = partial(jax.jit, static_argnames=static_argnames)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            tracing = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((args, kwargs)))
            return fn(*args, **kwargs) if tracing else call.jitted(*args, **kwargs)
        call.jitted = jitted
        return call
    return wrap


def guard(den, positive):
    """Denominators: an exact 0 (no valid key, or no feature mass) becomes 1, so the row outputs 0
    with finite gradients; otherwise positive kinds need nothing (stabilised den ≥ 1) and
    sign-indefinite kinds (trig, HRF) keep their sign with the magnitude floored at float32's tiny."""
    den = jnp.where(den == 0, 1.0, den)
    if positive:
        return jnp.maximum(den, TINY)
    return jnp.where(den >= 0, jnp.maximum(den, TINY), jnp.minimum(den, -TINY))


def finite_or(a, value=0.0):
    return jnp.where(jnp.isfinite(a), a, value)


# Prefix reductions along the sequence. jnp.cumsum and the lax.cum* reductions lower on CPU to a
# reduce_window as long as the axis, which XLA:CPU runs slowly: a running sum over 64 chunk states took
# 27 ms where their plain sum took 0.5, a running log-sum-exp over [4, 8192] scalars 26 ms. Running sums
# of [.., L, X] arrays are blocked matmuls with a lower-triangular matrix (`cumulative_sum`; 2–4× faster
# than jnp.cumsum there); running reductions of per-row scalars combine by doubling (`cumulative`: step
# k combines each element with the one 2^k before it, Hillis and Steele), in blocks. Either way a result
# combines elements at or before its own position only (a later element meets an exact 0 of the
# triangle), so no running quantity reads the future, bit for bit.
PREFIX_BLOCK = 64


def _shifted(a, k, fill, axis):
    """a moved k places along `axis` (out[i] = a[i − k]), the first k places `fill`."""
    pad = [(0, 0)] * a.ndim
    pad[axis] = (k, 0)
    return jax.lax.slice_in_dim(jnp.pad(a, pad, constant_values=fill), 0, a.shape[axis], axis=axis)


def _doubling(a, op, fill, axis):
    k = 1
    while k < a.shape[axis]:
        a = op(a, _shifted(a, k, fill, axis))
        k *= 2
    return a


def cumulative(a, op, fill, axis=2):
    """The inclusive prefix reduction of `a` along `axis` under the associative `op` (jnp.add,
    jnp.maximum, jnp.minimum, jnp.logaddexp) whose identity is `fill`: what jnp.cumsum / lax.cummax
    give, without their quadratic lowering on CPU (see PREFIX_BLOCK)."""
    axis = axis % a.ndim
    n = a.shape[axis]
    if n <= PREFIX_BLOCK:
        return _doubling(a, op, fill, axis)
    c = PREFIX_BLOCK
    blocks = -(-n // c)
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, blocks * c - n)
    a = jnp.pad(a, pad, constant_values=fill)
    a = a.reshape(*a.shape[:axis], blocks, c, *a.shape[axis + 1:])
    within = _doubling(a, op, fill, axis + 1)
    totals = jax.lax.index_in_dim(within, c - 1, axis + 1, keepdims=False)         # each block's whole
    before = _shifted(cumulative(totals, op, fill, axis), 1, fill, axis)          # the blocks before it
    out = op(jnp.expand_dims(before, axis + 1), within)
    out = out.reshape(*out.shape[:axis], blocks * c, *out.shape[axis + 2:])
    return jax.lax.slice_in_dim(out, 0, n, axis=axis)


def cumulative_sum(a, axis=2):
    """The running sum of `a` along `axis` (jnp.cumsum's result): within blocks of PREFIX_BLOCK a
    matmul with the lower triangle of ones, plus the blocks before (the same, over the blocks' totals).
    Full float32 precision on every backend (an accelerator's default matmul precision would round the
    terms to bfloat16 or TF32)."""
    axis = axis % a.ndim
    n = a.shape[axis]
    x = jnp.moveaxis(a, axis, -1)
    tri = lambda m: jnp.tril(jnp.ones((m, m), x.dtype))
    dot = partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    if n <= PREFIX_BLOCK:
        out = dot("...j,ij->...i", x, tri(n))
    else:
        c = PREFIX_BLOCK
        blocks = -(-n // c)
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * c - n)]).reshape(*x.shape[:-1], blocks, c)
        within = dot("...nj,ij->...ni", x, tri(c))
        # the blocks before each, shifted (not the inclusive sum minus the block's own total, which would
        # round with the block's later elements)
        before = _shifted(cumulative_sum(within[..., -1], axis=-1), 1, 0.0, within.ndim - 2)
        out = (within + before[..., None]).reshape(*x.shape[:-2], blocks * c)[..., :n]
    return jnp.moveaxis(out, -1, axis)


def _with_sign(f, s):
    return f if s is None else f * s


def _mask_keys(lk, valid):
    if valid is None:
        return lk
    return jnp.where(jnp.asarray(valid, bool)[:, None, :, None], lk, NEG_INF)


def ones_column(v):
    v = v.astype(F32)
    return jnp.concatenate([v, jnp.ones((*v.shape[:-1], 1), F32)], -1)


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
    return _divide(out[..., :-1], guard(out[..., -1], positive))


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


def jensen_floor(x, y, v, valid=None, causal=False, norms=None) -> Floor:
    """The denominator's floor for every query: x [B, H, Lq, D], y [B, H, Lk, D] the kernel's inputs,
    v [B, H, Lk, Dv], valid [B, Lk] or None; causal: queries aligned to the last keys, each seeing the
    keys up to its own position; norms: (log‖φ_q‖ [B, H, Lq], log‖φ_k‖ [B, H, Lk]) (`log_norm_bounds`) for
    the rounding bound's mass (`Floor.log_mass`), or None for a floor without it (diagnostics that only
    compare denominators with the bound).

    By Jensen (exp is convex), Σ_j exp(x_iᵀy_j) ≥ n_i·exp(x_iᵀȳ_i), ȳ_i the mean of the n_i keys query
    i sees: O(L·D), causal through prefix sums, and never looser than the norm bound
    n_i·e^(−‖x_i‖·max‖y_j‖) (since x_iᵀȳ_i ≥ −‖x_i‖‖ȳ_i‖). log is −inf for a query that sees no key."""
    x, y, v = x.astype(F32), y.astype(F32), v.astype(F32)
    l_q, l_k = x.shape[2], y.shape[2]
    w = jnp.ones((1, 1, l_k, 1), F32) if valid is None else jnp.asarray(valid, F32)[:, None, :, None]
    ones = jnp.broadcast_to(w, (w.shape[0], 1, l_k, 1))
    big = jnp.finfo(F32).max
    v_lo, v_hi = jnp.where(w > 0, v, big), jnp.where(w > 0, v, -big)
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
        nk = rows(cumulative(nk, jnp.logaddexp, NEG_INF)) if causal else jax.nn.logsumexp(nk, axis=2, keepdims=True)
        mass = jnp.where(count[..., 0] > 0, nq + nk, NEG_INF)
    return Floor(log=jnp.where(count[..., 0] > 0, log, NEG_INF), mean=vsum / n, low=low, high=high,
                 log_mass=mass)


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


def bidirectional_denominators(lq, sq, lk, sk, valid=None):
    """(the estimated denominators φ_q(i)ᵀΣ_j φ_k(j) [B, H, Lq] on each query's scale, that scale): the
    quantities `floored_ratio` compares with the floor, from whole log-feature arrays (for diagnostics;
    the pass itself forms them chunk by chunk)."""
    lk = _mask_keys(lk.astype(F32), valid)
    tau = sg(jnp.max(lk, axis=-2, keepdims=True))                               # [B, H, 1, F]
    w = jnp.where(jnp.isfinite(lk), jnp.exp(lk - finite_or(tau)), 0.0)
    ksum = jnp.sum(_with_sign(w, sk), axis=-2, keepdims=True)                    # [B, H, 1, F]
    lqt = jnp.where(jnp.isfinite(tau), lq.astype(F32) + finite_or(tau), NEG_INF)
    scale = jnp.max(lqt, axis=-1)
    fq = _with_sign(jnp.exp(lqt - finite_or(scale)[..., None]), sq)
    return jnp.sum(fq * ksum, -1), scale


def _bound(floor, scale):
    """(rows that have a bound, the bound on the row's scale; 0 where none). Double where: no inf or NaN
    of a row without a bound (no key, or an overflowed input) reaches the backward pass."""
    ok = jnp.isfinite(floor.log) & jnp.isfinite(scale)
    gap = jnp.where(ok, floor.log - jnp.where(ok, scale, 0.0), 0.0)
    return ok, jnp.where(ok, jnp.exp(jnp.minimum(gap, 80.0)), 0.0)


@jax.custom_jvp
def _divide(num, den):
    """num [.., Dv] / den [..]. Its derivative is written as (dnum − y·dden)/den with y = num/den, not
    autodiff's −num/den², whose den² underflows float32 for |den| < 1e-19 (a sign-indefinite kind's
    denominator can be that small): an inf there times a zero cotangent (an output the loss does not use)
    would be NaN for every key."""
    return num / den[..., None]


@_divide.defjvp
def _divide_jvp(primals, tangents):
    num, den = primals
    dnum, dden = tangents
    y = num / den[..., None]
    return y, (dnum - y * dden[..., None]) / den[..., None]


# -- bidirectional ------------------------------------------------------------------------------------
# The feature maps run chunk by chunk inside the passes over L, so a [chunk, F] block of features is made,
# used and dropped while it is in cache: written as whole [L, F] arrays, the features cost more memory
# traffic than the contractions once they leave the cache (BENCHMARKS.md, short-length-inline: the chunk
# sizes at L = 8192 and the whole-array sizes).
BIDIRECTIONAL_CHUNK = 512
# chunk_size="auto": whole arrays (no scan, no checkpoint recompute) while one [B, H, L, F] feature array
# holds at most this many elements (8 MiB of float32), chunks of BIDIRECTIONAL_CHUNK above: twice this
# size, whole arrays measured slower, at this size and below faster
WHOLE_ARRAY_ELEMENTS = 2 ** 21
# tokens per chunk of the causal pass: its [C, C] in-chunk products cost C·(F + Dv + 1) per query against
# the bidirectional pass's 2·F·(Dv + 1), so smaller chunks do less work, until XLA:CPU's batched matmuls
# of that size run too slowly: with spans of 512 (below), C = 64 measured fastest at L = 8192 (favor+,
# round-robin: forward 1.63× bidirectional against 1.79× at C = 128 and 1.81× at C = 32 with spans of
# 256; forward and backward 1.84× against 2.02×)
CAUSAL_CHUNK = 64


@jit_when_eager("query_map", "key_map", "positive", "chunk_size")
def bidirectional_maps(query_map, key_map, ctx, x, y, v, valid=None, positive=True,
                       chunk_size="auto", floor=None):
    """[B, H, Lq, Dv]: every query attends to every valid key (the bidirectional formula above), the
    features made from inputs chunk by chunk: query_map(ctx, x_chunk) and
    key_map(ctx, y_chunk) -> (log-features, sign or None) as above, for x, y pytrees of [B, H, L, ·]
    arrays (the maps must treat rows independently); chunk_size None: one chunk of the whole length
    (the array-at-once program); "auto": that while the feature arrays are small (WHOLE_ARRAY_ELEMENTS),
    else chunks of BIDIRECTIONAL_CHUNK. Jitted with the maps static when called eagerly; inside a
    caller's trace it is plain code.

    Keys first, in one scan: the per-feature key maximum τ is kept as a running maximum and the sum
    Σ_j exp(l_k(j) − τ)·sign·[v_j, 1] rescaled when it grows (as an online softmax), so it ends on the
    scale of the maximum over all valid keys; then the queries, chunk by chunk, with the key-aware
    stabiliser c_i = max_f(l_q(i, f) + τ_f). `floor` (sign-indefinite kinds): `jensen_floor` of the
    inputs, the bound each estimated denominator is raised to (`floored_ratio`)."""
    if chunk_size == "auto":
        lk1, sk1 = jax.eval_shape(key_map, ctx, jax.tree.map(lambda a: a[:, :, :1], y))
        rows = lk1.shape[0] * lk1.shape[1] * max(seq_length(x), seq_length(y))
        width = lk1.shape[-1] if sk1 is None else sk1.shape[-1]
        # per-row forms (trig, HRF) keep the chunks beyond one: their backward pass through whole arrays
        # measured slower than the chunks' recompute (BENCHMARKS.md, short-length-inline)
        small = rows * width <= WHOLE_ARRAY_ELEMENTS and not _row_scaled(lk1, sk1)
        chunk_size = None if small else BIDIRECTIONAL_CHUNK
    c = seq_length(y) if chunk_size is None else min(chunk_size, seq_length(y))
    # no mask at all when every key is real and the chunks divide L (no padding rows)
    unmasked = valid is None and seq_length(y) % c == 0
    ys, v1s = _in_chunks(y, c), _in_chunks(ones_column(v), c)
    valids = None if unmasked else _valid_chunks(valid, seq_length(y), c)

    def key_step(carry, chunk):
        tau, total = carry
        y_c, v1_c, valid_c = chunk
        lk, sk = key_map(ctx, y_c)
        lk = lk.astype(F32)
        if valid_c is not None:
            lk = jnp.where(valid_c[:, None, :, None], lk, NEG_INF)
        new = sg(jnp.maximum(tau, jnp.max(lk, axis=-2, keepdims=True)))    # [B, H, 1, F] (row form: F = 1)
        keep = jnp.where(jnp.isfinite(tau), jnp.exp(tau - finite_or(new)), 0.0)
        w = jnp.exp(lk - finite_or(new))                                  # ≤ 1; padded keys exactly 0
        if _row_scaled(lk, sk):
            # one scale per row: it weights the rows of [V, 1] instead of a pass over the [C, F] values
            add = jnp.einsum("bhld,bhlf->bhdf", v1_c * w, sk.astype(F32))
        else:
            # [V,1]ᵀΦ_k rather than Φ_kᵀ[V,1]: XLA:CPU then contracts L without transposing the features;
            # the ones column carries the normaliser through the same pass
            add = jnp.einsum("bhld,bhlf->bhdf", v1_c, _with_sign(w, sk))
        return (new, total * keep + add), None

    lk0, sk0 = jax.eval_shape(key_map, ctx, jax.tree.map(lambda a: a[0], ys))
    b, h, _, f = lk0.shape
    width = f if sk0 is None else sk0.shape[-1]
    init = (jnp.full((b, h, 1, f), NEG_INF, F32), jnp.zeros((b, h, v1s.shape[-1], width), F32))
    def query_chunk(tau, total, x_c, floor_c=None):
        # floor_c: this chunk's rows of the floor's per-query fields, (log, log_mass); its value
        # statistics are the same for every row
        floor_c = None if floor_c is None else dataclasses.replace(floor, log=floor_c[0], log_mass=floor_c[1])
        lq, sq = query_map(ctx, x_c)
        lqt = jnp.where(jnp.isfinite(tau), lq.astype(F32) + finite_or(tau), NEG_INF)   # on the key scale
        # the key-aware query stabiliser, floored inside the reduction (a row with no finite term, which
        # has no key or no feature mass, gets a finite scale and outputs 0): a guard after the maximum
        # would keep XLA:CPU from fusing the maximum, exp and contraction into one kernel
        scale = sg(jnp.max(jnp.maximum(lqt, LOWEST_SCALE), axis=-1, keepdims=True))
        if _row_scaled(lq, sq):
            out = jnp.einsum("bhlf,bhdf->bhld", sq.astype(F32), total) * jnp.exp(lqt - scale)
        else:
            out = jnp.einsum("bhlf,bhdf->bhld", _with_sign(jnp.exp(lqt - scale), sq), total)
        return ratio(out, positive, scale[..., 0], floor_c)

    if chunk_size is None or (c == seq_length(y) and chunk_size >= seq_length(x)):
        # the whole-array program: one step, no scan, no rematerialisation. For ReLU/ELU at any length
        # (maps too cheap for chunks to pay: BENCHMARKS), and for every kind whose keys and queries fit in
        # one chunk, where a scan of one step and a map of one chunk only add the checkpoint's recompute
        (tau, total), _ = key_step(init, jax.tree.map(lambda a: a[0], (ys, v1s, valids)))   # None stays None
        return query_chunk(tau, total, x, None if floor is None else (floor.log, floor.log_mass))
    # under jax.checkpoint the backward pass makes each chunk's features again, in cache, instead of
    # storing them all (faster at long L than storing them, and than the whole-array form: BENCHMARKS.md,
    # design-measurements)
    (tau, total), _ = jax.lax.scan(jax.checkpoint(key_step), init, (ys, v1s, valids))
    cq = min(chunk_size, seq_length(x))
    rows = lambda a: None if a is None else _in_chunks(jnp.broadcast_to(a, floor.log.shape)[..., None], cq)[..., 0]
    floors = None if floor is None else (rows(floor.log), rows(floor.log_mass))
    out = jax.lax.map(jax.checkpoint(lambda xf: query_chunk(tau, total, *xf)),
                      (_in_chunks(x, cq), floors))                                        # [N, B, H, C, Dv]
    n, b, h, _, dv = out.shape
    return jnp.moveaxis(out, 0, 2).reshape(b, h, n * cq, dv)[:, :, :seq_length(x)]


def seq_length(tree):
    return jax.tree.leaves(tree)[0].shape[2]


def _chunks(a, c, fill=0.0):
    """[B, H, L, X] -> [B, H, N, c, X], padded at the end with `fill` (zero: the caller drops or masks the
    padded rows; −inf for key log-features: no key)."""
    b, h, l, x = a.shape
    pad = (-l) % c
    if pad:
        a = jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=fill)
    return a.reshape(b, h, (l + pad) // c, c, x)


def _in_chunks(tree, c):
    """[B, H, L, ·] arrays -> [N, B, H, c, ·] (chunks leading, for a scan), zero-padded at the end."""
    return jax.tree.map(lambda a: jnp.moveaxis(_chunks(a, c), 2, 0), tree)


def _valid_chunks(valid, l, c):
    """valid [B, L] or None -> [N, B, c] booleans, the padding rows False."""
    n = -(-l // c)
    valid = jnp.ones((1, l), bool) if valid is None else jnp.asarray(valid, bool)
    valid = jnp.pad(valid, ((0, 0), (0, n * c - l)))
    return jnp.moveaxis(valid.reshape(valid.shape[0], n, c), 1, 0)


def _row_scaled(lk, sk):
    """The per-row form (favor.kernels.base): a log-scale [.., L, 1] and bounded values [.., L, F]."""
    return sk is not None and lk.shape[-1] == 1 and sk.shape[-1] > 1


# -- causal -------------------------------------------------------------------------------------------
# The causal pass is a scan over spans of CAUSAL_SPAN tokens (a whole number of chunks) that makes each
# span's features inside its step, as the bidirectional pass does, and carries the running key sum from
# span to span (a sequence of one span runs its step without the scan). Within a span the chunks of
# `chunk_size` tokens share one causal reference, so their states are on one scale and their prefixes
# are a plain cumulative sum (no scan over chunks).
CAUSAL_SPAN = 512


def _span(chunk, length, span=None):
    """Tokens per scan step: `span` (default CAUSAL_SPAN) rounded down to whole chunks, at least one chunk
    and at most the (chunk-padded) sequence."""
    per = max(1, (span or CAUSAL_SPAN) // chunk)
    return chunk * min(per, -(-length // chunk))


@jit_when_eager("query_map", "key_map", "positive", "chunk_size", "path", "span")
def causal_maps(query_map, key_map, ctx, x, y, v, valid=None, positive=True, chunk_size=CAUSAL_CHUNK,
                path="auto", span=None, floor=None):
    """[B, H, Lq, Dv] with query i seeing keys ≤ i + (Lk − Lq) (queries aligned to the last keys, as in
    decoding after a prefix), the features made from inputs span by span (maps and inputs as in
    `bidirectional_maps`). Every quantity the output at i is computed from — the fitted parameters are
    the caller's business — depends on keys ≤ i only.

    Two algorithms with the same result: "fast" (one matmul per chunk of `chunk_size` tokens, its
    prefix from the chunk states of the span and the carried sum) is exact while no key exceeds its
    span's causal reference by more than FAST_EXCEEDANCE; "exact" forms the diagonal blocks of
    EXACT_BLOCK tokens in log space and is exact for any input, at several times the cost. "auto" takes
    the fast one for each span unless one of its valid keys exceeds the bound (one `lax.cond` per
    span). The fast path's guarantee assumes every valid key's log-features are finite (true of every
    random-feature map; ReLU's zeros are not: its kind runs "auto" as "exact"). Forced "fast" outside
    the guarantee can be wrong, gradients included: it is for benchmarks and tests. "auto" decides per
    span on all its keys, so a later token of the same span can switch the path and move an output at
    rounding level (each path alone is causal bit for bit). `floor` as in `bidirectional_maps`
    (here `jensen_floor(..., causal=True)`: prefix sums, causal too).
    """
    if path not in PATHS:
        raise ValueError(f"unknown causal path {path!r}; valid: {', '.join(PATHS)}")
    l_q, l_k = seq_length(x), seq_length(y)
    if l_q > l_k:
        raise ValueError(f"causal attention aligns queries to the last keys and needs Lq ≤ Lk; "
                         f"got Lq = {l_q}, Lk = {l_k}")
    if l_q < l_k:   # queries i ↦ key position i + Lk − Lq; the front rows are computed and dropped
        x = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, 0), (l_k - l_q, 0), (0, 0))), x)
    out, scale = causal_sums(query_map, key_map, ctx, x, y, ones_column(v), valid, chunk_size, path, span)
    return ratio(out[:, :, l_k - l_q:], positive, scale[:, :, l_k - l_q:], floor)


@jit_when_eager("positive", "chunk_size")
def causal_plain(fq, fk, v, valid=None, positive=True, chunk_size=CAUSAL_CHUNK):
    """Causal attention for an elementwise feature map φ ≥ 0 with no exponential in it (ReLU, ELU + 1):
    the features fq = φ(x) [B, H, Lq, F], fk = φ(y) [B, H, Lk, F] are used as they are, not through log
    space — they cannot
    overflow (φ ≤ |u| + 1), so there is nothing for a stabiliser to do, and the log-space paths' −inf
    features (ReLU's exact zeros) would only push them onto the exact path at several times the cost.
    Chunks of `chunk_size`: each chunk's state Σ φ_k(j)[v_j, 1] (a matmul), the exclusive prefix of
    earlier chunks by a cumulative sum, the chunk's own keys by a masked [C, C] product. Queries aligned
    to the last keys (Lq ≤ Lk). Exact to rounding while `plain_features_safe` holds (products that
    underflow would be lost: features of 1e-19 whose products carry a row's only mass); a query whose
    features are all 0 outputs 0."""
    l_q, l_k = fq.shape[2], fk.shape[2]
    if l_q > l_k:
        raise ValueError(f"causal attention aligns queries to the last keys and needs Lq ≤ Lk; "
                         f"got Lq = {l_q}, Lk = {l_k}")
    fq = jnp.pad(fq.astype(F32), ((0, 0), (0, 0), (l_k - l_q, 0), (0, 0)))
    fk = _masked_features(fk.astype(F32), valid)
    c = min(chunk_size, l_k)
    fq_n, fk_n, v1_n = _chunks(fq, c), _chunks(fk, c), _chunks(ones_column(v), c)      # pad rows: zeros
    states = jnp.einsum("bhncd,bhncf->bhnfd", v1_n, fk_n)                                # [B, H, N, F, Dv+1]
    prefix = _shifted(cumulative_sum(states), 1, 0.0, 2)    # chunks before n (no chunk's own later keys)
    tril = jnp.tril(jnp.ones((c, c), bool))
    scores = jnp.where(tril, jnp.einsum("bhnif,bhnjf->bhnij", fq_n, fk_n), 0.0)
    out = jnp.einsum("bhnif,bhnfd->bhnid", fq_n, prefix) + jnp.einsum("bhnij,bhnjd->bhnid", scores, v1_n)
    b, h, n = out.shape[:3]
    return ratio(out.reshape(b, h, n * c, -1)[:, :, l_k - l_q:l_k], positive)


# causal_plain is exact to float32 rounding while every nonzero feature lies in [2^-60, 2^40]: every
# product of a query and a key feature is then a normal float32 (≥ 2^-120) and no sum over L·F < 2^47
# terms overflows. Kinds run it where that holds and the exact log-space path otherwise.
PLAIN_RANGE = (2.0 ** -60, 2.0 ** 40)


def plain_features_safe(fq, fk, valid=None):
    """Whether every nonzero feature of the queries and of the valid keys lies in PLAIN_RANGE (a scalar)."""
    lo, hi = PLAIN_RANGE
    ok = lambda f: jnp.all((f == 0) | ((f >= lo) & (f <= hi)))
    return ok(fq) & ok(_masked_features(fk, valid))


def _masked_features(fk, valid):
    """Plain key features [B, H, L, F] with the padded keys' set to 0."""
    return fk if valid is None else jnp.where(jnp.asarray(valid, bool)[:, None, :, None], fk, 0.0)


def causal_sums(query_map, key_map, ctx, x, y, v1, valid, chunk_size, path, span):
    """Σ_{j≤i} φ_q(i)ᵀφ_k(j)[v_j, 1] on query i's own scale, the features made from inputs and maps (as in
    `causal_maps`): (out [B, H, L, Dv+1], log-scale [B, H, L]), the true sums being e^scale · out; scale
    is −inf where query i sees no key (then out is 0). x and y have the same length."""
    l = seq_length(y)
    c = min(chunk_size, l)
    if path == "exact":       # one algorithm for the whole input: the features as whole arrays
        (lq, sq), (lk, sk) = query_map(ctx, x), key_map(ctx, y)
        lk = _mask_keys(lk.astype(F32), valid)
        return _causal_exact(lq.astype(F32), sq, lk, sk, v1, _anchor(lk), EXACT_BLOCK, c)
    s = _span(c, l, span)
    xs, ys, v1s, valids = _in_chunks(x, s), _in_chunks(y, s), _in_chunks(v1, s), _valid_chunks(valid, l, s)
    lk0, sk0 = jax.eval_shape(key_map, ctx, jax.tree.map(lambda a: a[0], ys))
    b, h, _, f = lk0.shape
    width = f if sk0 is None else sk0.shape[-1]
    init = (jnp.zeros((b, h), bool), jnp.full((b, h, f), NEG_INF, F32), jnp.zeros((b, h, width, v1.shape[-1]), F32))
    step = partial(_causal_span, query_map, key_map, ctx, c, path)
    if valids.shape[0] == 1:
        # one span (L ≤ its tokens): the step as plain code. A scan of one step only adds the checkpoint's
        # recompute of the span's features in the backward pass, and a larger program to compile; XLA:CPU's
        # temporary memory per layer is no higher without it (BENCHMARKS.md, one-span-causal-ab)
        _, (out, scale) = step(init, jax.tree.map(lambda a: a[0], (xs, ys, v1s, valids)))
        out, scale = out[None], scale[None]
    else:
        # under jax.checkpoint the backward pass makes each span's features again instead of storing them
        _, (out, scale) = jax.lax.scan(jax.checkpoint(step), init, (xs, ys, v1s, valids))
    n, b, h, _, d = out.shape
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * s, d)[:, :, :l]
    return out, jnp.moveaxis(scale, 0, 2).reshape(b, h, n * s)[:, :, :l]


def _causal_span(query_map, key_map, ctx, c, path, carry, inputs):
    """One span: (seen, τ, T) -> the same after it, and (out [B, H, S, Dv+1], log-scale [B, H, S]).

    The carry: `seen` [B, H] whether any valid key came before, τ [B, H, F] the per-feature maximum of
    those keys' log-features, T [B, H, F, Dv+1] = Σ_j exp(l_k(j) − τ)·sign·[v_j, 1] over them (τ read as
    0 where it is −inf). The span's reference τ0 is τ, or the span's first valid key when none came
    before (every query that sees any key sees that one): causal either way."""
    seen, tau, total = carry
    x, y, v1, valid = inputs
    lq, sq = query_map(ctx, x)
    lk, sk = key_map(ctx, y)
    lq, v1 = lq.astype(F32), v1.astype(F32)
    lk = jnp.where(valid[:, None, :, None], lk.astype(F32), NEG_INF)
    # [B, H, F], −inf: no key at all yet. The anchor (a pass over the span's keys) is only needed until
    # every row has seen a key, so after the first span it is skipped
    tau0 = sg(jax.lax.cond(jnp.all(seen), lambda: tau, lambda: jnp.where(seen[..., None], tau, _anchor(lk))))
    # [B, H, S], −inf exactly where a key has no mass (lk − finite τ0 is finite where lk is)
    a = sg(jnp.max(lk - finite_or(tau0)[:, :, None], axis=-1))
    new_tau = sg(jnp.maximum(tau0, jnp.max(lk, axis=2)))
    ops = (lq, sq, lk, sk, v1, a, seen, tau0, total, new_tau)
    if path == "fast":
        out, scale, total = _fast_span(*ops, c)
    else:
        out, scale, total = jax.lax.cond(jnp.max(a) <= FAST_EXCEEDANCE, lambda o: _fast_span(*o, c),
                                         lambda o: _exact_span(*o, c), ops)
    return (seen | jnp.any(jnp.isfinite(a), -1), new_tau, total), (out, scale)


def _carry_keep(tau0, new_tau):
    """The factor taking sums on scale τ0 to scale τ' ≥ τ0 (−inf read as 0; clamped below overflow for
    maps with −inf features, where τ may fall)."""
    return jnp.exp(jnp.minimum(finite_or(tau0) - finite_or(new_tau), 80.0))


def _fast_span(lq, sq, lk, sk, v1, a, seen, tau0, total, new_tau, c):
    """The fast path over one span, in chunks of c. Keys are referenced to τ0 and normalised by a
    per-key scalar a_j = max_f(l_k(j, f) − τ0_f); query i by β_i = max_f(l_q(i, f) + τ0_f). With
    α_i = max(0 if a key came before the span, max_{valid j ≤ i in the span} a_j) and c_i = β_i + α_i,

        out_i ∝ e^(−α_i)·[Q̂_i (T + P_n) + Σ_{j ≤ i in i's chunk} (Q̂_i·K̂_j)·e^(a_j)·[v_j, 1]],

    P_n the states of the span's earlier chunks, Σ_j K̂_j e^(a_j)[v_j, 1] on scale τ0: the key weights
    e^(a_j) are the states' own, so the in-chunk part is a masked matmul with no [S, C] exponential. Every
    factor is ≤ 1 but e^(a_j) ≤ e^FAST_EXCEEDANCE, the denominator ≥ e^(−α_i), and the result exact
    while every a_j ≤ FAST_EXCEEDANCE: a key whose e^(a_j) underflows (a_j < −87) is below F·e^(−87) of
    the denominator. Each factor depends on its own key or query and the carry only, so the pass is
    causal bit for bit (a chunk-wide reference would make earlier outputs round with later keys).
    Returns (out [B, H, S, Dv+1], its log-scale β_i + α_i, the carry's sum on scale τ')."""
    b, h, s, _ = lq.shape
    n = s // c
    t = finite_or(tau0)[:, :, None]                                # [B, H, 1, F]
    af = finite_or(a)
    beta = sg(finite_or(jnp.max(lq + t, axis=-1)))                # [B, H, S]
    row = _row_scaled(lk, sk)
    if row:
        # one scale per row: exp(l_k − τ − a_j) and exp(l_q + τ − β_i) are 1 in value, so the bounded
        # values serve as the features as they are, and those factors ([.., S, 1]: they carry the scales'
        # gradients) weight the rows of [V, 1] and of the output instead of the [S, F] values
        fk, fq = sk.astype(F32), sq.astype(F32)
        v1 = v1 * _unit(lk - t - af[..., None])
        q_unit = _unit(lq + t - beta[..., None])
    else:
        fk = _with_sign(jnp.exp(lk - t - af[..., None]), sk)
        fq = _with_sign(jnp.exp(lq + t - beta[..., None]), sq)
    alpha = cumulative(a, jnp.maximum, NEG_INF)                     # a is −inf exactly where no key
    alpha = sg(jnp.maximum(alpha, jnp.where(seen, 0.0, NEG_INF)[..., None]))
    scale = jnp.where(jnp.isfinite(alpha), beta + alpha, NEG_INF)  # −inf: no key yet
    alpha = finite_or(alpha)                                       # no key yet: the row is all zeros

    chunked = lambda z: z.reshape(b, h, n, c, *z.shape[3:])
    # key weights e^(a_j) (0: no key), clamped at FAST_EXCEEDANCE outside the guarantee (forced "fast")
    # so that the sums stay finite there too: an inf here would turn the zero gradient of an unused
    # output into NaN for every key
    w = jnp.where(jnp.isfinite(a), jnp.exp(jnp.minimum(a, FAST_EXCEEDANCE)), 0.0)
    fk_n, fq_n, v1w, alpha_n = map(chunked, (fk, fq, v1 * w[..., None], alpha))
    # chunk states on scale τ0, and each chunk's prefix: the carry plus the span's earlier chunks
    states = jnp.einsum("bhncd,bhncf->bhnfd", v1w, fk_n)                                # [B, H, N, F, Dv+1]
    inclusive = jnp.cumsum(states, axis=2)      # a few chunks per span: the plain running sum is fastest
    prefix = total[:, :, None] + jnp.concatenate([jnp.zeros_like(states[:, :, :1]), inclusive[:, :, :-1]], 2)
    tril = jnp.tril(jnp.ones((c, c), bool))
    scores = jnp.where(tril, jnp.einsum("bhnif,bhnjf->bhnij", fq_n, fk_n), 0.0)
    out = (jnp.exp(-alpha_n)[..., None] * (jnp.einsum("bhnif,bhnfd->bhnid", fq_n, prefix)
                                           + jnp.einsum("bhnij,bhnjd->bhnid", scores, v1w))).reshape(b, h, s, -1)
    if row:
        out = out * q_unit
    total = (total + inclusive[:, :, -1]) * _carry_keep(tau0, new_tau)[..., None]
    return out, scale, total


def _exact_span(lq, sq, lk, sk, v1, a, seen, tau0, total, new_tau, c):
    """The exact path over one span (`_causal_exact` after the carried sum); the carry's sum from the
    span's keys on scale τ'."""
    out, scale = _causal_exact(lq, sq, lk, sk, v1, tau0, EXACT_BLOCK, c, start=total, seen=seen)
    fk = _with_sign(jnp.exp(lk - finite_or(new_tau)[:, :, None]), sk)
    total = total * _carry_keep(tau0, new_tau)[..., None] + jnp.einsum("bhld,bhlf->bhfd", v1, fk)
    return out, scale, total


def _anchor(lk):
    """The first valid key's log-features [B, H, F] (−inf where a row has no valid key). Every query
    that sees any key sees this one, so it is a causal reference for the first chunk."""
    valid = _has_mass(lk)                                         # [B, H, L]
    first = jnp.argmax(valid, axis=-1)
    a = jnp.take_along_axis(lk, first[..., None, None], axis=2)[:, :, 0]
    return jnp.where(jnp.any(valid, -1)[..., None], a, NEG_INF)


def _has_mass(lk):
    """[..., L]: keys with some finite log-feature (valid, and not all-zero features)."""
    return jnp.isfinite(jnp.max(lk, axis=-1))


def _prefix_states(lk_c, sk_c, v1_c, anchor, start=None):
    """Per chunk n, the exclusive prefix Σ_{j in chunks < n} φ_k(j)[v_j, 1] on the scale τ_n:

    τ_n [B, H, N, F] = max(anchor, max of l_k over chunks < n) (−inf where nothing yet), and
    P_n [B, H, N, F, Dv+1] = Σ exp(l_k(j) − τ_n)·sign·[v_j, 1] (every term ≤ 1).
    One chunk state per chunk (a matmul), then a scan over chunks that rescales the running sum when
    the maximum grows, as an online softmax does. `start` [B, H, F, Dv+1]: a sum already there before the
    first chunk, on the scale `anchor` (zero when None).
    """
    # chunk maxima [B, H, N, F], under stop_gradient like every stabiliser: the scan's rescaling below
    # treats them as constants, so a gradient through this shift would not cancel (it once did not: the
    # causal key gradients were wrong while the outputs were right)
    mu = sg(jnp.max(lk_c, axis=3))
    fk = _with_sign(jnp.exp(lk_c - finite_or(mu)[:, :, :, None]), sk_c)
    states = jnp.einsum("bhncd,bhncf->bhnfd", v1_c, fk)            # [B, H, N, F, Dv+1] on scale μ_n

    def step(carry, x):
        tau, total = carry
        mu_n, s_n = x
        new = jnp.maximum(tau, mu_n)
        keep = jnp.where(jnp.isfinite(tau), jnp.exp(tau - finite_or(new)), 0.0)
        add = jnp.where(jnp.isfinite(mu_n), jnp.exp(mu_n - finite_or(new)), 0.0)
        return (new, total * keep[..., None] + s_n * add[..., None]), (tau, total)

    mu_t = jnp.moveaxis(mu, 2, 0)
    init = (sg(anchor), jnp.zeros_like(states[:, :, 0]) if start is None else start)
    _, (tau, prefix) = jax.lax.scan(step, init, (mu_t, jnp.moveaxis(states, 2, 0)))
    return jnp.moveaxis(tau, 0, 2), jnp.moveaxis(prefix, 0, 2)


def _chunked_with_prefix(lq, sq, lk, sk, v1, anchor, size, start=None):
    """Everything in chunks of `size` (c, N, then q, sign, k, sign, [v, 1] as [B, H, N, c, ·]) and the
    prefix states before each chunk on its causal scale τ_n (anchor included; `start` a sum before it)."""
    c = min(size, lq.shape[2])
    chunk = lambda a: None if a is None else _chunks(a, c)
    lk_c = _chunks(lk, c, NEG_INF)                       # padded rows: no key
    sk_c, v1_c = chunk(sk), chunk(v1)
    tau_p, prefix = _prefix_states(lk_c, sk_c, v1_c, anchor, start)
    return c, lk_c.shape[2], chunk(lq), chunk(sq), lk_c, sk_c, v1_c, tau_p, prefix


def _unit(log_one):
    """exp of a [.., 1] log-factor that is 0 where finite (−inf: a row without mass, → 0), with its
    gradient: 1 in value, d/dx = 1, and no inf reaching the backward pass."""
    finite = jnp.isfinite(log_one)
    return jnp.where(finite, jnp.exp(jnp.where(finite, log_one, 0.0)), 0.0)


def _causal_exact(lq, sq, lk, sk, v1, anchor, block, chunk_size, start=None, seen=None):
    """Exact for any input: chunks of `chunk_size` tokens, each meeting the prefix of earlier chunks
    through states on their causal scale τ_n (as the fast path), and within the chunk blocks of `block`
    tokens whose diagonal blocks are formed in log space (`_exact_chunk`). The chunks run one at a time
    (lax.map) under jax.checkpoint, so neither the forward nor the backward ever holds more than one
    chunk's [block, block, F] terms: the path's memory is that of the fast path, whatever L.
    `start` [B, H, F, Dv+1]: a sum of earlier keys on the scale `anchor`; `seen` [B, H]: whether there
    were any (a span of the causal scan)."""
    b, h, l, f = lq.shape
    size = block * -(-min(chunk_size, l) // block)                  # a whole number of blocks
    c, n, lq_c, sq_c, lk_c, sk_c, v1_c, tau_p, prefix = _chunked_with_prefix(
        lq, sq, lk, sk, v1, anchor, size, start)
    first = lambda a: None if a is None else jnp.moveaxis(a, 2, 0)
    body = jax.checkpoint(lambda xs: _exact_chunk(*xs, block))
    out, ci = jax.lax.map(body, tuple(map(first, (lq_c, sq_c, lk_c, sk_c, v1_c, tau_p, prefix))))
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, -1)[:, :, :l]
    ci = jnp.moveaxis(ci, 0, 2).reshape(b, h, n * c)[:, :, :l]
    # the scale is −inf for queries before the first valid key: τ of the first block is the anchor,
    # which such a query has not seen, so c_i there is no term's size (the row is all zeros)
    seen_i = cumulative(_has_mass(lk), jnp.logical_or, False)
    if seen is not None:
        seen_i = seen_i | seen[..., None]
    return out, jnp.where(seen_i, ci, NEG_INF)


def _exact_chunk(lq, sq, lk, sk, v1, tau0, start, block):
    """One chunk [B, H, C, ·] (C a multiple of `block`) after a prefix `start` on scale τ0: blocks of
    `block` tokens, the prefix of earlier blocks through states, the diagonal block in log space: for
    j ≤ i in the block the terms exp(l_q(i, f) + l_k(j, f) − c_i) are formed one by one, with c_i the
    maximum over the prefix (l_q + τ_n) and over those terms — every term ≤ 1 and the largest = 1, for
    any inputs. Returns (out [B, H, C, Dv+1], c_i [B, H, C])."""
    b, h, l, f = lq.shape
    c, n, lq_c, sq_c, lk_c, sk_c, v1_c, tau_p, prefix = _chunked_with_prefix(lq, sq, lk, sk, v1, tau0, block,
                                                                            start)
    lqt = jnp.where(jnp.isfinite(tau_p)[:, :, :, None], lq_c + finite_or(tau_p)[:, :, :, None], NEG_INF)
    tril = jnp.tril(jnp.ones((c, c), bool))[:, :, None]
    pair = jnp.where(tril, lq_c[:, :, :, :, None, :] + lk_c[:, :, :, None, :, :], NEG_INF)   # [B,H,N,i,j,F]
    ci = sg(finite_or(jnp.maximum(jnp.max(lqt, axis=-1), jnp.max(pair, axis=(-2, -1)))))
    fq = _with_sign(jnp.exp(lqt - ci[..., None]), sq_c)
    terms = jnp.exp(pair - ci[..., None, None])
    if sq_c is not None:
        terms = terms * sq_c[:, :, :, :, None, :] * sk_c[:, :, :, None, :, :]
    scores = jnp.sum(terms, axis=-1)
    out = jnp.einsum("bhnif,bhnfd->bhnid", fq, prefix) + jnp.einsum("bhnij,bhnjd->bhnid", scores, v1_c)
    return out.reshape(b, h, n * c, -1)[:, :, :l], ci.reshape(b, h, n * c)[:, :, :l]


# -- decoding -----------------------------------------------------------------------------------------
def decode_init(batch, heads, features, dv, dim=None):
    """The causal state after no token: the running per-feature key maximum τ and the sum
    Σ_j φ_k(j)[v_j, 1] on its scale; with `dim` (sign-indefinite kinds) also what the denominator's floor
    needs (`jensen_floor`): the sums of the kernel's key inputs and of the values, their count, and the
    values' running minimum and maximum."""
    state = {"tau": jnp.full((batch, heads, features), NEG_INF, F32),
             "sum": jnp.zeros((batch, heads, features, dv + 1), F32)}
    if dim is not None:
        big = jnp.finfo(F32).max
        state.update(ysum=jnp.zeros((batch, heads, dim), F32), vsum=jnp.zeros((batch, heads, dv), F32),
                     count=jnp.zeros((batch, 1), F32), vmin=jnp.full((batch, heads, dv), big, F32),
                     vmax=jnp.full((batch, heads, dv), -big, F32), knorm=jnp.full((batch, heads), NEG_INF, F32))
    return state


FLOOR_STATE = ("ysum", "vsum", "count", "vmin", "vmax", "knorm")


def decode_floor(state, x, y, v, valid=None, norms=None):
    """(the floor's part of the state with key input y [B, H, D] and value v [B, H, Dv] counted, the
    `Floor` of query x [B, H, D]) for a state that keeps it (`decode_init(..., dim)`); ({}, None) else.
    norms: (log‖φ_q‖, log‖φ_k‖) [B, H] of this token's query and key (`log_norm_bounds`), for the floor's
    mass."""
    if "ysum" not in state:
        return {}, None
    w = jnp.ones((y.shape[0], 1), F32) if valid is None else jnp.asarray(valid, F32)[:, None]
    real = w[..., None] > 0
    v = v.astype(F32)
    new = {"ysum": state["ysum"] + w[..., None] * y.astype(F32), "vsum": state["vsum"] + w[..., None] * v,
           "count": state["count"] + w, "vmin": jnp.where(real, jnp.minimum(state["vmin"], v), state["vmin"]),
           "vmax": jnp.where(real, jnp.maximum(state["vmax"], v), state["vmax"])}
    n = jnp.maximum(new["count"], 1.0)
    log = jnp.log(n) + jnp.einsum("bhd,bhd->bh", x.astype(F32), new["ysum"]) / n
    mass = None
    if norms is not None:
        nq, nk = (sg(a.astype(F32)) for a in norms)
        new["knorm"] = jnp.logaddexp(state["knorm"], jnp.where(w > 0, nk, NEG_INF))
        mass = jnp.where(new["count"] > 0, nq + new["knorm"], NEG_INF)
    return new, Floor(log=jnp.where(new["count"] > 0, log, NEG_INF), mean=new["vsum"] / n[..., None],
                      low=new["vmin"], high=new["vmax"], log_mass=mass)


def decode_absorb(state, lk, sk, v):
    """The state after one more key: lk [B, H, F] (−inf: no key), sk its sign or None, v [B, H, Dv]."""
    tau = sg(jnp.maximum(state["tau"], lk))
    keep = jnp.where(jnp.isfinite(state["tau"]), jnp.exp(state["tau"] - finite_or(tau)), 0.0)
    fk = _with_sign(jnp.where(jnp.isfinite(lk), jnp.exp(lk - finite_or(tau)), 0.0), sk)
    total = state["sum"] * keep[..., None] + fk[..., None] * ones_column(v)[..., None, :]
    return {"tau": tau, "sum": total}


def decode_read(state, lq, sq):
    """Query lq [B, H, F] against the state: (out [B, H, Dv+1], log-scale [B, H]), the true sums being
    e^scale · out; −inf where no key was absorbed. The query's stabiliser knows the keys, as in the
    bidirectional pass."""
    tau = state["tau"]
    lqt = jnp.where(jnp.isfinite(tau), lq + finite_or(tau), NEG_INF)
    scale = sg(jnp.max(lqt, axis=-1))
    fq = _with_sign(jnp.exp(lqt - finite_or(scale)[..., None]), sq)
    return jnp.einsum("bhf,bhfd->bhd", fq, state["sum"]), scale


def decode_prefill(lk, sk, v, valid=None, dim=None, y=None):
    """The state `decode_step` reaches after absorbing keys lk [B, H, L, F | 1] (sign sk [B, H, L, F] or
    None), values v [B, H, L, Dv] and key inputs y [B, H, L, D] one at a time, computed at once (the
    prefill of a prompt): τ the keys' maximum, the sum of their features on it, and with `dim` the
    floor's sums. valid [B, L]: keys that count (the others are absorbed as no key, as decode_step does)."""
    b, h, l = v.shape[:3]
    lk = lk.astype(F32)
    if valid is not None:
        lk = jnp.where(jnp.asarray(valid, bool)[:, None, :, None], lk, NEG_INF)
    features = lk.shape[-1] if sk is None else sk.shape[-1]
    tau = sg(jnp.broadcast_to(jnp.max(lk, axis=2), (b, h, features)) if l else jnp.full((b, h, features), NEG_INF, F32))
    fk = _with_sign(jnp.where(jnp.isfinite(lk), jnp.exp(lk - finite_or(tau)[:, :, None]), 0.0), sk)
    state = {"tau": tau, "sum": jnp.einsum("bhlf,bhld->bhfd", jnp.broadcast_to(fk, (b, h, l, features)),
                                           ones_column(v))}
    if dim is not None:
        w = jnp.ones((b, l), F32) if valid is None else jnp.asarray(valid, F32)
        real = w[:, None, :, None] > 0
        v = v.astype(F32)
        big = jnp.finfo(F32).max
        state.update(ysum=jnp.einsum("bl,bhld->bhd", w, y.astype(F32)), vsum=jnp.einsum("bl,bhld->bhd", w, v),
                     count=jnp.sum(w, axis=1, keepdims=True),
                     vmin=jnp.min(jnp.where(real, v, big), axis=2, initial=big),
                     vmax=jnp.max(jnp.where(real, v, -big), axis=2, initial=-big),
                     knorm=sg(jax.nn.logsumexp(jnp.where(real[..., 0], log_norm_bounds(lk, sk), NEG_INF),
                                               axis=2)))
    return state


def decode_step(state, lq, sq, lk, sk, v, valid=None, positive=True, x=None, y=None):
    """One token: lq, lk [B, H, F], v [B, H, Dv], valid [B] or None -> (out [B, H, Dv], state).
    The same stabilisers as the causal pass with every key a chunk of its own: exact. x, y [B, H, D]:
    the kernel's inputs, for a state that keeps the denominator's floor (sign-indefinite kinds)."""
    lq, lk = lq.astype(F32), lk.astype(F32)
    if valid is not None:
        lk = jnp.where(jnp.asarray(valid, bool)[:, None, None], lk, NEG_INF)
    sums, floor = decode_floor(state, x, y, v, valid, (log_norm_bounds(lq, sq), log_norm_bounds(lk, sk)))
    state = {**decode_absorb(state, lk, sk, v), **sums}
    out, scale = decode_read(state, lq, sq)
    return ratio(out, positive, scale, floor), state
