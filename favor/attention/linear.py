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
stabilisers included (favor.attention.causal). Sequence sums and carried states accumulate in float32.

This module holds what every pass shares (the guard, running sums and maxima, chunking, the division
whose derivative stays finite); the passes are favor.attention.bidirectional, .causal and .decoding,
and the sign-indefinite kinds' floor favor.attention.floor.
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp


F32 = jnp.float32
TINY = float(jnp.finfo(jnp.float32).tiny)
NEG_INF = -jnp.inf
LOWEST_SCALE = -1e30     # a stabiliser's floor: finite, and below any finite log-feature that matters

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


def combine(parts):
    """(Σ of (out, log-scale) parts on the largest scale of each row, that scale); parts with scale −inf
    hold nothing."""
    top = jnp.max(jnp.stack([s for _, s in parts]), axis=0)
    total = 0.0
    for out, s in parts:
        total = total + out * jnp.where(jnp.isfinite(s), jnp.exp(s - finite_or(top)), 0.0)[..., None]
    return total, top


# -- packed documents (favor.attention.documents) --------------------------------------------------------
NO_RUN = -1     # the run of a position that holds no key at all (shifted-in rows, the carry before any key)


def segmented(a, r, op, fill, axis=-1):
    """The inclusive prefix reduction of `a` along `axis` under `op` (identity `fill`: the scan needs none,
    every position holding its own value), restarting at every change of run: out_i = op over j ≤ i in
    i's run. r broadcasts against `a` with the same axis. A work-efficient parallel scan
    (jax.lax.associative_scan) of (run, value) pairs under the segmented operator: a block's value covers
    its last element's run, so adjacent blocks whose last elements share a run (runs are contiguous: then
    every element between them does) combine, and otherwise the right block's value stands. (log2 L
    doubling steps over whole arrays made the floor's per-document statistics cost 6× the pass they
    floor: CPU, L = 2048.)"""
    del fill
    return segmented_all({"a": a}, jnp.expand_dims(r, tuple(range(a.ndim - r.ndim))), {"a": op}, axis)["a"]


def segmented_all(parts, r, ops, axis=-1):
    """`segmented` of every array of the dict `parts` at once, each under its op (`ops`, by name), all
    restarting at the runs r (which broadcasts against each; leading axes r lacks are added): one scan,
    whose run comparisons every array shares, where one scan per array would repeat them."""
    ndim = max(a.ndim for a in parts.values())
    r = jnp.expand_dims(r, tuple(range(ndim - r.ndim)))
    axis = axis % ndim

    def ranked(x, n):
        # r (or a comparison of runs) as an array of n dims: its trailing axes beyond n (of size 1) dropped
        return x if x.ndim == n else jnp.reshape(x, x.shape[:n])

    # the scan interleaves each leaf on its own: each array takes the shape its values take once r broadcasts
    parts = {name: jnp.broadcast_to(a, jnp.broadcast_shapes(a.shape, ranked(r, a.ndim).shape))
             for name, a in parts.items()}

    def combine(left, right):
        (r1, v1), (r2, v2) = left, right
        same = r1 == r2
        return r2, {name: jnp.where(ranked(same, v.ndim), ops[name](v1[name], v), v) for name, v in v2.items()}

    return jax.lax.associative_scan(combine, (r, parts), axis=axis)[1]
