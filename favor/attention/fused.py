"""Fused random-feature attention: Pallas kernels for the positive exponential maps (FAVOR+, FAVOR++,
FAVOR#, SimRF), feature map, stabilisers, chunk recurrence and normaliser in one kernel per pass.

The maps enter as log-linear forms, log φ(u) = u·P + c + r(u) (`ExponentialMechanism.log_linear`):
P [.., D, F] the projection with any transform folded in, c [.., F] a per-feature constant, r [.., L] a
per-row term (−½||u'||² and the like). The kernel forms [chunk, F] log-features from [chunk, D] inputs
in registers and never writes an [L, F] array: what reaches memory is the inputs, the output, one
log-normaliser per row and one reference per chunk (what the backward pass reads).

Each program is one (batch, head, block of features, segment of the sequence) and walks its segment in
chunks of `chunk` tokens (segments: see "calls" below):
- bidirectional: a pass over the key chunks with a running per-feature maximum τ_f (the state
  T = Σ_j exp(l_k(j) − τ)[v_j, 1] rescaled when τ grows: every key factor ≤ 1), then a pass over the
  query chunks with exp(l_q(i) + τ − β_i), β_i = max_f(l_q(i, f) + τ_f): the same stabilisers as
  favor.attention.linear's bidirectional pass, so the denominator is ≥ 1 and no relevant term underflows.
- causal: favor.attention.causal's fast chunk form, chunk after chunk: keys referenced to the carried τ (or the first
  valid key before any), a per-key scalar a_j = max_f(l_k(j, f) − τ_f) that weights the values by
  e^(a_j), a running α_i = max_{j ≤ i} a_j that divides, the in-chunk part a masked [c, c] product, the
  earlier chunks through the carried state. Every factor depends on its own token and the carry, so
  the pass is causal bit for bit. A row is exact while every a_j of its keys is ≤ EXCEEDANCE; the kernel
  writes each a_j, and `attend` names the rows at or after a key beyond the bound (in their own batch,
  head and document), whose outputs the caller takes from favor's exact XLA path. Every other row keeps
  the kernel's output, which no such key touches.

Backward: a custom VJP with kernels of its own, the stabilisers constants (they cancel in the ratio).
With h_i = [g_i, −g_i·o_i] / den_i (g the output's cotangent, o the output):
    ∂/∂l_q(i, f) = φ_q(i, f) Σ_{j ≤ i} φ_k(j, f) [v_j, 1]·h_i        (a pass in sequence order)
    ∂/∂l_k(j, f) = φ_k(j, f) [v_j, 1]·Σ_{i ≥ j} φ_q(i, f) h_i,   ∂/∂v_j = Σ_{i ≥ j} (φ_q(i)·φ_k(j)) g_i/den_i
(causal: ∂l_q in sequence order from the prefix state, ∂l_k and ∂v in reverse order with the suffix
state U = Σ_i φ_q(i) h_iᵀ, two kernels; bidirectional: all i, j, the queries' kernel summing U).
Every product φ_q(i, f) φ_k(j, f) / den_i is formed as exp(l_q + ρ − log den_i)·exp(l_k − ρ) with a
reference ρ the forward pass used, each factor ≤ 1 (≤ e^EXCEEDANCE for a causal in-chunk key). The
fitted parameters and the draw get no gradient here (P and c are constants of the call: the caller
refuses fit_gradients=True).

Packed documents (`attend(..., runs=)`): kernels of their own (the section "packed documents" below), so a
call without documents runs exactly the kernels above.

On CPU the kernels run in Pallas interpret mode (what the tests check); on GPU they lower through
Triton, with float32-level products on the tensor cores by default (PRECISION, PRECISIONS). How a call
is cut and run (chunk, feature block, the map's own feature count, launch, precision) is a `Plan`, a
static argument of every kernel: features past the map's own count pad a block and are masked by their
index, never by a value they hold.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from favor.attention import causal as causal_lib, documents, linear

F32 = jnp.float32
LOW = linear.LOWEST_SCALE   # "no reference yet" / "no key": finite, so no −inf − (−inf)
EXCEEDANCE = causal_lib.FAST_EXCEEDANCE   # the causal chunk form's bound on a_j
HIGHEST = jax.lax.Precision.HIGHEST


# The kernels' matrix products on a GPU: "highest" is IEEE float32 (Triton then uses no tensor cores),
# "tf32x3" three TF32 passes on the tensor cores, "bf16" bf16 operands with float32 accumulation. Measured
# on an H200 (BENCHMARKS.md, accel-nvidia-h200): against favor+'s XLA pass at full float32 precision the
# kernel differs by 1.3e-6 (highest), 2.0e-6 (tf32x3) and 3.9e-3 (bf16) in its outputs, and "highest"
# ran the causal forward pass 22 times slower than "tf32x3" (92 against 4.2 ms at L = 1024): "tf32x3" is
# the default. Interpret mode (CPU) always runs "highest".
PRECISIONS = {"highest": HIGHEST, "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
              "bf16": jax.lax.DotAlgorithmPreset.BF16_BF16_F32}
PRECISION = "tf32x3"


# -- what the kernels read -------------------------------------------------------------------------
# Every kernel takes its operands in named groups (pallas_call hands a kernel its inputs' refs in the
# inputs' own structure) and writes named output refs. Inside a kernel the fields are refs over the
# program's block (its rows of one batch and head, its block of features); outside, the padded arrays.
class Side(NamedTuple):
    """One side's log-linear map: log φ(u) = x·proj + const + row, x [rows, D], row [rows], proj [D, F]
    and const [F] (the module docstring's P, c and r(u))."""
    x: Any
    row: Any
    proj: Any
    const: Any


class Keys(NamedTuple):
    """The key side: its map, the values v [rows, Dv] and valid [rows] (1.0 a key, 0.0 padding)."""
    map: Side
    v: Any
    valid: Any


class State(NamedTuple):
    """Keys summed on their per-feature maximum tau [F] (LOW: no key yet), every factor ≤ 1:
    t = Σ_j exp(l_k(j) − tau) v_j [F, Dv] and z = Σ_j exp(l_k(j) − tau) [F]."""
    tau: Any
    t: Any
    z: Any


class Sums(NamedTuple):
    """The backward pass's query sums U on a reference ρ (module docstring: U = Σ_i φ_q(i) h_iᵀ, the
    factors exp(l_q(i) + ρ − log den_i)): u = Σ_i … g_i [F, Dv] and d = −Σ_i … δ_i [F]."""
    u: Any
    d: Any


class Forward(NamedTuple):
    """What the backward kernels read of the forward pass: the output o [rows, Dv], its cotangent g, the
    row's log-denominator lden [rows], the reference each chunk's keys were taken on, refs [chunks, F]
    (causal), and the log-denominator's own cotangent gl [rows] (documents: their bidirectional call
    combines two passes by it)."""
    o: Any
    g: Any
    lden: Any
    refs: Any = None
    gl: Any = None


class Tools(NamedTuple):
    """What a kernel body computes with: its matrix product at the call's precision (a static argument of
    the kernel), the mask of its feature block's real features (the padded width past the map's own
    count holds none) and the chunk length."""
    dot: Any
    real: Any
    chunk: int


def _dot(a, b, ta=False, tb=False, *, precision):
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _tools(block, features, precision, chunk):
    real = pl.program_id(2) * block + _iota(block) < features
    return Tools(functools.partial(_dot, precision=precision), real, chunk)


def _iota(n):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _rows(i, c):
    return pl.ds(pl.multiple_of(i * c, c), c)


def _load(ref, rows):
    return ref[rows].astype(F32) if len(ref.shape) == 1 else ref[rows, :].astype(F32)


def _chunks(ref, c):
    """How many chunks of c rows the program's segment holds (its block of a rows operand)."""
    return ref.shape[0] // c


def _params(side):
    """A side's map parameters (proj, const), loaded once per program."""
    return side.proj[...], side.const[...]


def _log_features(tools, side, params, rows, valid=None):
    """[chunk, F] log-features of the side's rows; LOW in the features that only pad the block (they set
    no maximum and weigh nothing) and, given `valid`, in the rows without a key."""
    proj, const = params
    lf = tools.dot(_load(side.x, rows), proj) + const[None, :] + _load(side.row, rows)[:, None]
    keep = tools.real[None, :] if valid is None else valid[:, None] & tools.real[None, :]
    return jnp.where(keep, lf, LOW)


def _valid(keys, rows):
    return keys.valid[rows] > 0


def _reference(lk, val, seen, tau):
    """The chunk's key reference τ0 [F]: the carry once a valid key came before, else the chunk's first
    valid key (every query that sees a key sees that one); zeros while no key at all (unused then)."""
    c = lk.shape[0]
    idx = _iota(c)
    first = jnp.min(jnp.where(val, idx, c))
    anchor = jnp.sum(jnp.where((idx == first)[:, None], lk, 0.0), axis=0)
    return jnp.where(seen > 0, tau, anchor)


class Terms(NamedTuple):
    """A causal chunk's stabilised factors on its keys' references: a [c] (a_j, each key's excess over its
    reference; LOW for padding), beta [c] (β_i), fq = exp(l_q + ρ_i − β) [c, F], fk = exp(l_k − ρ_j − a)
    [c, F] (0 for padded keys and features), the key weights w = e^min(a, EXCEEDANCE) [c] and the mask of
    the pairs a query sees [c, c]."""
    a: Any
    beta: Any
    fq: Any
    fk: Any
    w: Any
    mask: Any


def _causal_terms(tools, lq, lk, val, tau0):
    """`Terms` on one reference τ0 for every key and query (no documents)."""
    idx = _iota(lk.shape[0])
    a = jnp.where(val, jnp.max(jnp.where(tools.real[None, :], lk - tau0[None, :], LOW), axis=1), LOW)
    beta = jnp.max(lq + tau0[None, :], axis=1)
    fk = jnp.where(val[:, None] & tools.real[None, :], jnp.exp(lk - tau0[None, :] - a[:, None]), 0.0)
    fq = jnp.exp(lq + tau0[None, :] - beta[:, None])
    w = jnp.where(val, jnp.exp(jnp.minimum(a, EXCEEDANCE)), 0.0)
    return Terms(a, beta, fq, fk, w, idx[:, None] >= idx[None, :])


def _key_state(tools, keys, params, n):
    """`State` over the program's n chunks of keys: the running per-feature key maximum and the sums on it."""
    f, dv = params[0].shape[1], keys.v.shape[1]

    def body(i, state):
        rows = _rows(i, tools.chunk)
        val = _valid(keys, rows)
        lk = _log_features(tools, keys.map, params, rows, val)
        tau = jnp.maximum(state.tau, jnp.max(lk, axis=0))
        keep = jnp.exp(state.tau - tau)
        fk = jnp.where(val[:, None] & tools.real[None, :], jnp.exp(lk - tau[None, :]), 0.0)
        return State(tau, state.t * keep[:, None] + tools.dot(fk, _load(keys.v, rows), ta=True),
                     state.z * keep + jnp.sum(fk, axis=0))

    init = State(jnp.full((f,), LOW, F32), jnp.zeros((f, dv), F32), jnp.zeros((f,), F32))
    return jax.lax.fori_loop(0, n, body, init)


def _key_state_kernel(keys: Keys, tau_ref, t_ref, z_ref, *, chunk, features, precision):
    tools = _tools(keys.map.proj.shape[1], features, precision, chunk)
    state = _key_state(tools, keys, _params(keys.map), _chunks(keys.valid, chunk))
    tau_ref[...], t_ref[...], z_ref[...] = state


# -- causal ----------------------------------------------------------------------------------------
def _causal_fwd_kernel(q: Side, k: Keys, entering: State, o_ref, lden_ref, refs_ref, a_ref, *, chunk, features,
                       precision):
    """The chunk form, chunk after chunk, from the state of the keys before the segment (`entering`); writes
    the output, the log-denominator, each chunk's reference and each key's a_j."""
    tools = _tools(q.proj.shape[1], features, precision, chunk)
    qp, kp = _params(q), _params(k.map)

    def body(i, carry):
        seen, state = carry
        rows = _rows(i, chunk)
        val = _valid(k, rows)
        lq, lk = _log_features(tools, q, qp, rows), _log_features(tools, k.map, kp, rows, val)
        v = _load(k.v, rows)
        tau0 = _reference(lk, val, seen, state.tau)
        x = _causal_terms(tools, lq, lk, val, tau0)
        # α_i = max(0 if a key came before the chunk, max_{j ≤ i} a_j): the row's own causal divisor
        alpha = jnp.max(jnp.where(x.mask, x.a[None, :], LOW), axis=1)
        alpha = jnp.where(seen > 0, jnp.maximum(alpha, 0.0), alpha)
        has = alpha > 0.5 * LOW
        scale = jnp.exp(-jnp.where(has, alpha, 0.0))
        wv = v * x.w[:, None]
        s = jnp.where(x.mask, tools.dot(x.fq, x.fk, tb=True), 0.0)
        num = (tools.dot(x.fq, state.t) + tools.dot(s, wv)) * scale[:, None]
        den = (jnp.sum(x.fq * state.z[None, :], axis=1) + jnp.sum(s * x.w[None, :], axis=1)) * scale
        o_ref[rows, :] = (num / linear.guard(den, True)[:, None]).astype(o_ref.dtype)
        # log of the true denominator Σ_j φ_q(i)·φ_k(j): what the backward pass divides by
        lden_ref[rows] = jnp.where(has & (den > 0), jnp.log(jnp.maximum(den, 1e-37)) + alpha + x.beta, LOW)
        refs_ref[i, :] = tau0
        a_ref[rows] = x.a
        tau = jnp.maximum(tau0, jnp.max(lk, axis=0))
        keep = jnp.exp(tau0 - tau)
        state = State(tau, (state.t + tools.dot(x.fk, wv, ta=True)) * keep[:, None],
                      (state.z + jnp.sum(x.fk * x.w[:, None], axis=0)) * keep)
        return jnp.maximum(seen, jnp.max(jnp.where(val, 1.0, 0.0))), state

    # the earlier segments' key state on its running maximum (LOW: no key before)
    start = State(entering.tau[...], entering.t[...], entering.z[...])
    seen = jnp.max(jnp.where(start.tau > 0.5 * LOW, 1.0, 0.0))
    jax.lax.fori_loop(0, _chunks(k.valid, chunk), body, (seen, start))


class Chunk(NamedTuple):
    """What both causal backward sweeps read of one chunk: its rows, which hold a key (val), the keys'
    log-features lk, the reference tau0 the forward pass took, its `Terms`, r_i = exp(β_i − log den_i),
    the output's cotangent g, δ_i = g_i·o_i (minus the log-denominator's cotangent, documents) and the
    values v."""
    rows: Any
    val: Any
    lk: Any
    tau0: Any
    terms: Terms
    r: Any
    g: Any
    delta: Any
    v: Any


def _backward_rows(fwd, rows, beta, lden_cotangent=False):
    """(r, g, δ) of a chunk's rows: r_i = exp(min(β_i − log den_i, 0)) (0 for a row with no key). β_i ≤ log
    den_i wherever the chunk form is exact (the reference is reached by a key the row sees); the clamp
    keeps r finite in a row beyond it, whose output the caller takes from the exact path (its cotangent
    here is 0) but whose terms must not be NaN (0·inf)."""
    lden = _load(fwd.lden, rows)
    r = jnp.exp(jnp.where(lden > 0.5 * LOW, jnp.minimum(beta - lden, 0.0), LOW))
    g = _load(fwd.g, rows)
    delta = jnp.sum(g * _load(fwd.o, rows), axis=1)
    if lden_cotangent:
        delta = delta - _load(fwd.gl, rows)
    return r, g, delta


def _causal_chunk(tools, q, k, fwd, qp, kp, i):
    rows = _rows(i, tools.chunk)
    val = _valid(k, rows)
    lq, lk = _log_features(tools, q, qp, rows), _log_features(tools, k.map, kp, rows, val)
    tau0 = fwd.refs[i, :]
    terms = _causal_terms(tools, lq, lk, val, tau0)
    return Chunk(rows, val, lk, tau0, terms, *_backward_rows(fwd, rows, terms.beta), _load(k.v, rows))


def _key_grads(tools, rows, x: Terms, r, g, delta, v, ek, sums, kproj, dx_ref, drow_ref, dv_ref):
    """Writes ∂x, ∂r and ∂v of a chunk's keys: from the later chunks' query sums (`sums` on ρ, through
    ek = exp(l_k − ρ)) and from the chunk's own queries (the masked pairs); returns fr = fq·r, this chunk's
    queries' share of the sums the earlier chunks read."""
    fr = x.fq * r[:, None]
    b = jnp.where(x.mask, tools.dot(g, v, tb=True) - delta[:, None], 0.0)          # [i, j]
    s = jnp.where(x.mask, tools.dot(x.fq, x.fk, tb=True), 0.0)
    dlk = ek * (tools.dot(v, sums.u, tb=True) + sums.d[None, :]) + x.fk * x.w[:, None] * tools.dot(b, fr, ta=True)
    dv = tools.dot(ek, sums.u) + x.w[:, None] * tools.dot(s, g * r[:, None], ta=True)
    dv_ref[rows, :] = dv.astype(dv_ref.dtype)
    dx_ref[rows, :] = tools.dot(dlk, kproj, tb=True)
    drow_ref[rows] = jnp.sum(dlk, axis=1)
    return fr


def _causal_dq_kernel(q: Side, k: Keys, fwd: Forward, entering: State, dx_ref, drow_ref, *sum_refs, chunk,
                      features, precision):
    """∂l_q in sequence order from the prefix state the forward pass carried (the earlier segments' as it
    entered this one); with `sum_refs` (u, d: a call of several segments) also the segment's own query
    sums U_s on the reference R of its first chunk, which the key sweeps of the earlier segments read (one
    segment has no earlier one: the sums are not formed)."""
    tools = _tools(q.proj.shape[1], features, precision, chunk)
    qp, kp = _params(q), _params(k.map)
    first = fwd.refs[0, :] if sum_refs else None

    def body(i, carry):
        t, z, sums = carry
        ch = _causal_chunk(tools, q, k, fwd, qp, kp, i)
        x = ch.terms
        wv = ch.v * x.w[:, None]
        m = jnp.where(x.mask, tools.dot(ch.g, wv, tb=True) - ch.delta[:, None] * x.w[None, :], 0.0)
        dlq = x.fq * ch.r[:, None] * (tools.dot(ch.g, t, tb=True) - ch.delta[:, None] * z[None, :]
                                      + tools.dot(m, x.fk))
        dx_ref[ch.rows, :] = tools.dot(dlq, qp[0], tb=True)
        drow_ref[ch.rows] = jnp.sum(dlq, axis=1)
        keep = jnp.exp(ch.tau0 - jnp.maximum(ch.tau0, jnp.max(ch.lk, axis=0)))[:, None]
        t, z = (t + tools.dot(x.fk, wv, ta=True)) * keep, (z + jnp.sum(x.fk * x.w[:, None], axis=0)) * keep[:, 0]
        if sum_refs:
            # this chunk's rows on the segment's first reference (τ0 ≥ it once a key was seen; rows before any
            # key have r = 0)
            fr = x.fq * (ch.r[:, None] * jnp.exp(jnp.minimum(first - ch.tau0, 0.0))[None, :])
            sums = Sums(sums.u + tools.dot(fr, ch.g, ta=True), sums.d - jnp.sum(fr * ch.delta[:, None], axis=0))
        return t, z, sums

    shapes = [ref.shape for ref in sum_refs] or [(1, 1), (1,)]
    init = (entering.t[...], entering.z[...], Sums(*(jnp.zeros(s, F32) for s in shapes)))
    *_, sums = jax.lax.fori_loop(0, _chunks(k.valid, chunk), body, init)
    if sum_refs:
        sum_refs[0][...], sum_refs[1][...] = sums


def _causal_dk_kernel(q: Side, k: Keys, fwd: Forward, later: Sums, next_ref, dx_ref, drow_ref, dv_ref, *,
                      chunk, features, precision):
    """∂l_k and ∂v in reverse: U = Σ_{i in later chunks} exp(l_q(i) + ρ − log den_i)[g_i, −δ_i] on ρ = the
    next chunk's reference, which bounds every key of this chunk (exp(l_k − ρ) ≤ 1); it enters the segment
    as the later segments' sums (`later`) on the next segment's first reference (`next_ref`)."""
    tools = _tools(q.proj.shape[1], features, precision, chunk)
    qp, kp = _params(q), _params(k.map)
    n = _chunks(k.valid, chunk)
    after = next_ref[...]

    def body(step, sums):
        i = n - 1 - step
        ch = _causal_chunk(tools, q, k, fwd, qp, kp, i)
        x = ch.terms
        rho = jnp.where(i + 1 < n, fwd.refs[jnp.minimum(i + 1, n - 1), :], after)
        ek = jnp.where(ch.val[:, None] & tools.real[None, :], jnp.exp(jnp.minimum(ch.lk - rho[None, :], 0.0)), 0.0)
        fr = _key_grads(tools, ch.rows, x, ch.r, ch.g, ch.delta, ch.v, ek, sums, kp[0], dx_ref, drow_ref, dv_ref)
        keep = jnp.exp(jnp.minimum(ch.tau0 - rho, 0.0))
        return Sums(sums.u * keep[:, None] + tools.dot(fr, ch.g, ta=True),
                    sums.d * keep - jnp.sum(fr * ch.delta[:, None], axis=0))

    jax.lax.fori_loop(0, n, body, Sums(later.u[...], later.d[...]))


# -- bidirectional ---------------------------------------------------------------------------------
def _query_terms(tools, q, qp, rows, tau):
    """(β_i, exp(l_q(i) + τ − β_i)) of a chunk's queries against the key state's maximum τ."""
    lq = _log_features(tools, q, qp, rows)
    beta = jnp.max(lq + tau[None, :], axis=1)
    return beta, jnp.exp(lq + tau[None, :] - beta[:, None])


def _bidir_fwd_kernel(q: Side, keys: State, o_ref, lden_ref, *, chunk, features, precision):
    """The queries of one segment against the key state of every key: exp(l_q(i) + τ − β_i), β_i =
    max_f(l_q(i, f) + τ_f), so the denominator is ≥ 1 and no relevant term underflows."""
    tools = _tools(q.proj.shape[1], features, precision, chunk)
    qp = _params(q)
    tau, t, z = keys.tau[...], keys.t[...], keys.z[...]

    def body(i, _):
        rows = _rows(i, chunk)
        beta, fq = _query_terms(tools, q, qp, rows, tau)
        den = jnp.sum(fq * z[None, :], axis=1)
        o_ref[rows, :] = (tools.dot(fq, t) / linear.guard(den, True)[:, None]).astype(o_ref.dtype)
        lden_ref[rows] = jnp.where(den > 0, jnp.log(jnp.maximum(den, 1e-37)) + beta, LOW)
        return 0

    jax.lax.fori_loop(0, _chunks(q.row, chunk), body, 0)


def _bidir_dq_kernel(q: Side, keys: State, fwd: Forward, dx_ref, drow_ref, u_ref, d_ref, *, chunk, features,
                     precision):
    """∂l_q of one segment's queries, and their sums U_s (all on the one key reference τ: the segments'
    sums add)."""
    tools = _tools(q.proj.shape[1], features, precision, chunk)
    qp = _params(q)
    tau, t, z = keys.tau[...], keys.t[...], keys.z[...]

    def body(i, sums):
        rows = _rows(i, chunk)
        beta, fq = _query_terms(tools, q, qp, rows, tau)
        # β_i ≤ log den_i: the denominator holds the term of the feature that sets β_i (den ≥ 1 on β's scale)
        r, g, delta = _backward_rows(fwd, rows, beta)
        fr = fq * r[:, None]
        dlq = fr * (tools.dot(g, t, tb=True) - delta[:, None] * z[None, :])
        dx_ref[rows, :] = tools.dot(dlq, qp[0], tb=True)
        drow_ref[rows] = jnp.sum(dlq, axis=1)
        return Sums(sums.u + tools.dot(fr, g, ta=True), sums.d - jnp.sum(fr * delta[:, None], axis=0))

    init = Sums(jnp.zeros(u_ref.shape, F32), jnp.zeros(d_ref.shape, F32))
    u_ref[...], d_ref[...] = jax.lax.fori_loop(0, _chunks(q.row, chunk), body, init)


def _bidir_dk_kernel(k: Keys, tau_ref, queries: Sums, dx_ref, drow_ref, dv_ref, *, chunk, features, precision):
    """∂l_k and ∂v of one segment's keys from every query's sums U on the keys' maximum τ."""
    tools = _tools(k.map.proj.shape[1], features, precision, chunk)
    kp = _params(k.map)
    tau, u, d = tau_ref[...], queries.u[...], queries.d[...]

    def body(i, _):
        rows = _rows(i, chunk)
        val = _valid(k, rows)
        lk = _log_features(tools, k.map, kp, rows)
        ek = jnp.where(val[:, None] & tools.real[None, :], jnp.exp(jnp.minimum(lk - tau[None, :], 0.0)), 0.0)
        dlk = ek * (tools.dot(_load(k.v, rows), u, tb=True) + d[None, :])
        dv_ref[rows, :] = tools.dot(ek, u).astype(dv_ref.dtype)
        dx_ref[rows, :] = tools.dot(dlk, kp[0], tb=True)
        drow_ref[rows] = jnp.sum(dlk, axis=1)
        return 0

    jax.lax.fori_loop(0, _chunks(k.valid, chunk), body, 0)


# -- calls -----------------------------------------------------------------------------------------
# Programs: one per (batch, head, block of features (TUNING), segment of the sequence). The features
# are independent given the row's normaliser, so each block runs the passes above over its own features
# with its own stabilisers; the forward pass combines the blocks' normalised outputs by their log-
# denominators (a log-sum-exp, `combine_blocks`), and the backward pass reads the combined normaliser and
# output. Splitting the features keeps each program's tiles and state ([64, Dv]) small enough for its
# shared memory.
#
# Segments: a program walks its segment chunk by chunk, so a call of few (batch, head) pairs at long L
# would leave the device idle while a handful of programs walk the whole sequence. A call is split into
# segments until it has about SEGMENT_PROGRAMS programs: one pass computes each segment's key state (τ_s,
# T_s, z_s) in parallel, a few small XLA ops combine them into the state that enters each segment (the
# earlier segments' for causal, all for bidirectional), and the main pass runs every segment from its
# entering state. The backward pass does the same for the query sums U of the key gradients.
SEGMENT_PROGRAMS = 512     # about four programs per streaming multiprocessor of an H100/H200 (132)
MAX_SEGMENTS = 64          # bounds the [S, S] combination below

# How each call is cut and launched: (mode, precision) -> (tokens per chunk, features per block, warps per
# program, Triton's software-pipelining stages). Measured on an H200 (BENCHMARKS.md, after the section
# accel-nvidia-h200-tuned-causal: the kernels alone, forward+backward, L = 4K and 32K, bf16 inputs, 16
# heads, F = 256). The causal kernels hold many [chunk, block] tiles at once (the key backward ten
# products a chunk): chunks of 64 ran 1.5× slower than chunks of 32 with bf16 products, and with tf32x3,
# whose split operands double the live tiles, chunks of 32 and blocks of 32 features ran 2.1× faster than
# 64 and 64; two pipelining stages took another 9–10 % off with bf16. The bidirectional kernels hold few
# tiles and were fastest with chunks of 64 (32 and 16: 4–43 % slower). 8 warps and blocks of 128 features
# were slower everywhere. Interpret mode (CPU) cuts calls the same way, so the tests run the shapes a GPU
# does. "highest" (IEEE float32 products, 22× slower) keeps the untuned DEFAULT_TUNING.
TUNING = {("causal", "bf16"): (32, 64, 4, 2), ("causal", "tf32x3"): (32, 32, 4, 1),
          ("bidirectional", "bf16"): (64, 64, 4, 2), ("bidirectional", "tf32x3"): (64, 64, 4, 1)}
DEFAULT_TUNING = (64, 64, 4, 1)


def tuning(causal, precision):
    """(chunk, feature block, warps, stages) of a call: TUNING's entry for the mode and precision."""
    return TUNING.get(("causal" if causal else "bidirectional", precision), DEFAULT_TUNING)


def _segments(length, c, programs, want=None):
    """(segments, padded rows) of a sequence of `length` rows in chunks of c: up to `want` segments (default:
    enough for SEGMENT_PROGRAMS programs beside `programs`, at most MAX_SEGMENTS) of equal whole chunks,
    the sequence padded to them. The fewest segments that keep the most chunks per segment, so the padding
    is under one chunk per segment (67 chunks in up to 64 segments: 34 of 2, padded by one chunk)."""
    n = -(-length // c)
    want = max(1, SEGMENT_PROGRAMS // programs) if want is None else want
    per = -(-n // max(1, min(n, want, MAX_SEGMENTS)))          # chunks per segment
    segments = -(-n // per)
    return segments, segments * per * c


def _spec(kind, shape, fb, seg, bcast=(False, False)):
    """The BlockSpec of one operand over the (batch, head, feature block, segment) grid. kind: 'rows' [B, H,
    L, ...] and 'valid' [B, L] (the segment's rows), 'proj' [Bp, Hp, D, F] and 'const' [Bp, Hp, F] (feature-
    sliced, broadcast dims read at 0), 'block' [B, H, G, X, ...] (the feature block's slot, X split by
    segment), 'feat' [B, H, F] and 'feat_cols' [B, H, F, Dv] (one state for all segments), 'seg_feat' [B, H,
    S, F] and 'seg_cols' [B, H, S, F, Dv] (the segment's state), 'chunk_feat' [B, H, N, F] (its chunks')."""
    pick = lambda b, h: (0 if bcast[0] else b, 0 if bcast[1] else h)
    zeros = lambda k: [0] * (len(shape) - k)
    if kind == "rows":
        return pl.BlockSpec((None, None, shape[2] // seg, *shape[3:]), lambda b, h, g, s: (b, h, s, *zeros(3)))
    if kind == "valid":
        return pl.BlockSpec((None, shape[1] // seg), lambda b, h, g, s: (b, s))
    if kind == "proj":
        return pl.BlockSpec((None, None, shape[2], fb), lambda b, h, g, s: (*pick(b, h), 0, g))
    if kind == "const":
        return pl.BlockSpec((None, None, fb), lambda b, h, g, s: (*pick(b, h), g))
    if kind == "block":
        return pl.BlockSpec((None, None, None, shape[3] // seg, *shape[4:]), lambda b, h, g, s: (b, h, g, s, *zeros(4)))
    if kind == "feat":
        return pl.BlockSpec((None, None, fb), lambda b, h, g, s: (b, h, g))
    if kind == "feat_cols":
        return pl.BlockSpec((None, None, fb, shape[3]), lambda b, h, g, s: (b, h, g, 0))
    if kind == "seg_feat":
        return pl.BlockSpec((None, None, None, fb), lambda b, h, g, s: (b, h, s, g))
    if kind == "seg_cols":
        return pl.BlockSpec((None, None, None, fb, shape[4]), lambda b, h, g, s: (b, h, s, g, 0))
    if kind == "row_one":
        return pl.BlockSpec((None, 1), lambda b, h, g, s: (b, 0))
    if kind == "chunk_feat":
        return pl.BlockSpec((None, None, shape[2] // seg, fb), lambda b, h, g, s: (b, h, s, g))
    raise ValueError(kind)


def _compiler(interpret, launch):
    if interpret:
        return {}
    from jax.experimental.pallas import triton as plgpu
    return {"compiler_params": plgpu.CompilerParams(num_warps=launch[0], num_stages=launch[1])}


class Plan(NamedTuple):
    """How a call is cut and run, static (a part of the compiled program): tokens per chunk, features per
    program (`block`), the map's own feature count (the padded width beyond it holds no feature), interpret
    mode, the launch (warps, Triton's pipelining stages) and the products' precision (a PRECISIONS name;
    interpret mode runs "highest")."""
    chunk: int
    block: int
    features: int
    interpret: bool
    launch: tuple
    precision: str


@dataclasses.dataclass(frozen=True)
class Op:
    """One operand of a kernel call: the array and how the grid reads it (`_spec`'s kinds)."""
    array: Any
    kind: str


def _call(kernel, inputs, outs, grid, plan):
    """pallas_call of kernel(chunk=, features=, precision=the products' precision) over grid (B, H, G, S).
    inputs: the kernel's positional inputs, each an `Op` or a NamedTuple (`Side`, `Keys`, ...) of them,
    which the kernel receives as refs in the same structure; outs [(shape, kind)] (float32), its output
    refs after them."""
    b, h = grid[:2]
    bcast = lambda a: (a.shape[0] == 1 and b > 1, a.shape[1] == 1 and h > 1)
    spec = lambda o: _spec(o.kind, o.array.shape, plan.block, grid[3],
                           bcast(o.array) if o.kind in ("proj", "const") else (False, False))
    leaf = lambda x: isinstance(x, Op)
    in_specs = [jax.tree.map(spec, x, is_leaf=leaf) for x in inputs]
    args = [jax.tree.map(lambda o: o.array, x, is_leaf=leaf) for x in inputs]
    precision = HIGHEST if plan.interpret else PRECISIONS[plan.precision]
    body = functools.partial(kernel, chunk=plan.chunk, features=plan.features, precision=precision)
    return pl.pallas_call(
        body, out_shape=[jax.ShapeDtypeStruct(s, F32) for s, _ in outs], grid=grid, in_specs=in_specs,
        out_specs=[_spec(k, s, plan.block, grid[3]) for s, k in outs], interpret=plan.interpret,
        **_compiler(plan.interpret, plan.launch))(*args)


def _total(tau, t, z):
    """The segments' key states (τ_s [B, H, S, F], LOW where a segment has no key; T_s, z_s on τ_s) -> the
    state of all keys on their maximum."""
    top = jnp.max(tau, axis=2)
    w = jnp.exp(tau - top[:, :, None])                  # ≤ 1; a segment with no key has T_s = z_s = 0
    return top, jnp.sum(w[..., None] * t, axis=2), jnp.sum(w * z, axis=2)


def _before(s, later=False):
    """[S, S', 1]: whether segment s' comes before segment s (after it, with later=True)."""
    i = jnp.arange(s)
    return ((i[None, :] > i[:, None]) if later else (i[None, :] < i[:, None]))[:, :, None]


def _prefix(tau, t, z):
    """The state entering each segment: the earlier segments' keys on their running maximum (LOW and zeros
    before the first key). A segment's weight for its own and later segments is exactly 0, so no later
    key changes what enters an earlier segment, bit for bit."""
    before = _before(tau.shape[2])
    top = jnp.max(jnp.where(before, tau[:, :, None], LOW), axis=3)                       # [B, H, S, F]
    w = jnp.where(before, jnp.exp(jnp.minimum(tau[:, :, None] - top[:, :, :, None], 0.0)), 0.0)
    return (top, jnp.einsum("bhstf,bhtfd->bhsfd", w, t, precision=HIGHEST),
            jnp.einsum("bhstf,bhtf->bhsf", w, z, precision=HIGHEST))


def _suffix(first, nxt, ug, ud):
    """The query sums entering each segment's key sweep: Σ over later segments s' of U_s' (on its first
    chunk's reference R_s') moved to the next segment's first reference R_{s+1} (≤ R_s' once a key was
    seen; before that no valid key reads them)."""
    later = _before(first.shape[2], later=True)
    w = jnp.where(later, jnp.exp(jnp.minimum(nxt[:, :, :, None] - first[:, :, None], 0.0)), 0.0)
    return (jnp.einsum("bhstf,bhtfd->bhsfd", w, ug, precision=HIGHEST),
            jnp.einsum("bhstf,bhtf->bhsf", w, ud, precision=HIGHEST))


def combine_blocks(o, lden):
    """The blocks' outputs o [B, H, G, L, Dv], each normalised over its own features, and their log-
    denominators [B, H, G, L] (LOW: no mass) -> the output and the row's log-denominator over all features."""
    top = jnp.max(lden, axis=2, keepdims=True)
    w = jnp.where(lden > 0.5 * LOW, jnp.exp(lden - top), 0.0)
    den = jnp.sum(w, axis=2)
    out = jnp.sum(w[..., None] * o, axis=2) / jnp.where(den > 0, den, 1.0)[..., None]
    return out, jnp.where(den > 0, top[:, :, 0] + jnp.log(jnp.where(den > 0, den, 1.0)), LOW)


def _state_outs(b, h, s, f, dv):
    return [((b, h, s, f), "seg_feat"), ((b, h, s, f, dv), "seg_cols"), ((b, h, s, f), "seg_feat")]


def _side(x, r, p, c):
    return Side(Op(x, "rows"), Op(r, "rows"), Op(p, "proj"), Op(c, "const"))


def _keys(xk, rk, pk, ck, v, val):
    return Keys(_side(xk, rk, pk, ck), Op(v, "rows"), Op(val, "valid"))


def _forward(ops, causal, segs, plan):
    """(out [B, H, Lq, Dv], log-denominator [B, H, Lq], what the backward pass reads, a_j [B, H, Lk]: each
    key's excess over its chunk's reference (causal; LOW for padding and bidirectional calls))."""
    xq, rq, xk, rk, v, val, pq, cq, pk, ck = ops
    b, h, lq, _ = xq.shape
    lk, dv, f = xk.shape[2], v.shape[-1], pq.shape[-1]
    g = f // plan.block
    call = functools.partial(_call, plan=plan)
    q, k = _side(xq, rq, pq, cq), _keys(xk, rk, pk, ck, v, val)
    sq, sk = segs
    if sk > 1 or not causal:
        states = call(_key_state_kernel, [k], _state_outs(b, h, sk, f, dv), (b, h, g, sk))
    rows = [((b, h, g, lq, dv), "block"), ((b, h, g, lq), "block")]
    if causal:
        if sk > 1:
            entering = State(*_prefix(*states))
        else:
            entering = State(jnp.full((b, h, 1, f), LOW, F32), jnp.zeros((b, h, 1, f, dv), F32),
                             jnp.zeros((b, h, 1, f), F32))
        state_ops = State(Op(entering.tau, "seg_feat"), Op(entering.t, "seg_cols"), Op(entering.z, "seg_feat"))
        outs = rows + [((b, h, lk // plan.chunk, f), "chunk_feat"), ((b, h, g, lk), "block")]
        o, lden, refs, excess = call(_causal_fwd_kernel, [q, k, state_ops], outs, (b, h, g, sk))
        out, lden = combine_blocks(o, lden)
        return out, lden, (refs, entering.t, entering.z), jnp.max(excess, axis=2)
    keys = State(*_total(*states))
    key_ops = State(Op(keys.tau, "feat"), Op(keys.t, "feat_cols"), Op(keys.z, "feat"))
    out, lden = combine_blocks(*call(_bidir_fwd_kernel, [q, key_ops], rows, (b, h, g, sq)))
    return out, lden, keys, jnp.full((b, h, lk), LOW, F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12))
def _core(xq, rq, xk, rk, v, val, pq, cq, pk, ck, causal, segs, plan):
    out, _, _, excess = _forward((xq, rq, xk, rk, v, val, pq, cq, pk, ck), causal, segs, plan)
    return out, excess


def _core_fwd(xq, rq, xk, rk, v, val, pq, cq, pk, ck, causal, segs, plan):
    ops = (xq, rq, xk, rk, v, val, pq, cq, pk, ck)
    out, lden, saved, excess = _forward(ops, causal, segs, plan)
    return (out, excess), (ops, out, lden, saved)


def _core_bwd(causal, segs, plan, residuals, cotangents):
    ops, out, lden, saved = residuals
    g = cotangents[0].astype(F32)
    xq, rq, xk, rk, v, val, pq, cq, pk, ck = ops
    b, h, lq, dq = xq.shape
    lk, dk, dv, f = xk.shape[2], xk.shape[3], v.shape[-1], pq.shape[-1]
    nb = f // plan.block
    sq, sk = segs
    call = functools.partial(_call, plan=plan)
    q, k = _side(xq, rq, pq, cq), _keys(xk, rk, pk, ck, v, val)
    q_outs = [((b, h, nb, lq, dq), "block"), ((b, h, nb, lq), "block")]
    k_outs = [((b, h, nb, lk, dk), "block"), ((b, h, nb, lk), "block"), ((b, h, nb, lk, dv), "block")]
    if causal:
        refs, t, z = saved
        fwd = Forward(Op(out, "rows"), Op(g, "rows"), Op(lden, "rows"), Op(refs, "chunk_feat"))
        grid = (b, h, nb, sk)
        sums = _state_outs(b, h, sk, f, dv)[1:] if sk > 1 else []
        entering = State(None, Op(t, "seg_cols"), Op(z, "seg_feat"))
        dxq, drq, *parts = call(_causal_dq_kernel, [q, k, fwd, entering], q_outs + sums, grid)
        first = refs[:, :, ::refs.shape[2] // sk]
        nxt = jnp.concatenate([first[:, :, 1:], refs[:, :, -1:]], axis=2)
        # no segment after the last: one segment's key sweep starts from nothing
        later = Sums(*_suffix(first, nxt, *parts)) if sk > 1 else Sums(jnp.zeros((b, h, 1, f, dv), F32),
                                                                        jnp.zeros((b, h, 1, f), F32))
        later = Sums(Op(later.u, "seg_cols"), Op(later.d, "seg_feat"))
        dxk, drk, dvv = call(_causal_dk_kernel, [q, k, fwd, later, Op(nxt, "seg_feat")], k_outs, grid)
    else:
        keys = State(Op(saved.tau, "feat"), Op(saved.t, "feat_cols"), Op(saved.z, "feat"))
        fwd = Forward(Op(out, "rows"), Op(g, "rows"), Op(lden, "rows"))
        dxq, drq, u, d = call(_bidir_dq_kernel, [q, keys, fwd], q_outs + _state_outs(b, h, sq, f, dv)[1:],
                              (b, h, nb, sq))
        queries = Sums(Op(jnp.sum(u, axis=2), "feat_cols"), Op(jnp.sum(d, axis=2), "feat"))
        dxk, drk, dvv = call(_bidir_dk_kernel, [k, keys.tau, queries], k_outs, (b, h, nb, sk))
    dxq, drq, dxk, drk, dvv = (jnp.sum(p, axis=2) for p in (dxq, drq, dxk, drk, dvv))   # the feature blocks' shares
    zero = lambda a: jnp.zeros_like(a)
    return (dxq.astype(xq.dtype), drq, dxk.astype(xk.dtype), drk, dvv.astype(v.dtype), zero(val),
            zero(pq), zero(cq), zero(pk), zero(ck))


_core.defvjp(_core_fwd, _core_bwd)


# -- packed documents ------------------------------------------------------------------------------
# With segment ids (favor.attention.documents: a document is a run of equal consecutive ids) the causal
# kernels take each token's run, queries' and keys' apart (`qrun`, `krun`: the bidirectional call's
# reversed pass shifts keys against queries). A query sees the keys ≤ it of its own run. The carry is the
# state of the document of the last key slot before the chunk (its run `crun`, its maximum τ, LOW while it
# has no valid key), read only by the chunk's queries of that run, and restarted where the chunk's last
# slot belongs to another document. Every stabiliser is a document's own: a key's reference is the carried
# τ while its document is the carried one, else its document's first valid key in the chunk (every query
# that sees a key of its document in the chunk sees that one), so a document of small logits after one of
# large logits keeps its digits. a_j, α_i and the exceedance bound are then as in the kernels above.
# One segment per call (a fold of the segments' carries across documents is not written): these kernels
# walk the whole sequence, and favor calls them only with impl='pallas'.
def _at(x, k):
    """x[k] of a loaded vector, as a reduction (the kernel languages extract no scalar from a vector)."""
    return jnp.sum(jnp.where(_iota(x.shape[0]) == k, x, jnp.zeros_like(x)))


def _pick(dot, onehot, x):
    """onehot [n, c] (rows of one 1 or none) @ x [c, F], exact at every PRECISIONS setting: x as three bf16
    parts, each picked exactly by a product whose operands are rounded to bf16 (or TF32) at most. A
    reference rounded by the product (|l|·2⁻⁹ under "bf16") could exceed every key the row sees, which the
    backward pass's β_i ≤ log den_i needs."""
    parts = []
    for _ in range(3):
        part = x.astype(jnp.bfloat16).astype(F32)
        parts.append(part)
        x = x - part
    return sum(dot(onehot, part) for part in parts)


class Runs(NamedTuple):
    """Each row's document: the queries' runs and the keys' [rows] (the reversed pass shifts keys against
    queries)."""
    q: Any
    k: Any


class Carried(NamedTuple):
    """The state a chunk enters with: whether its document has a key yet (seen), that document's key
    maximum tau [F] (LOW while none) and its run."""
    seen: Any
    tau: Any
    run: Any


class DocTerms(NamedTuple):
    """`Terms` with documents: each row on its own document's reference, the mask (j ≤ i, one run), which
    queries read the carried state (`reads`) and the keys' references kref [c, F]."""
    terms: Terms
    reads: Any
    kref: Any


def _doc_terms(tools, lq, lk, val, runs, carried):
    """The chunk's factors with documents, given the carried document."""
    c = lk.shape[0]
    idx = _iota(c)
    held = carried.seen > 0
    lk0 = jnp.where(val[:, None], lk, 0.0)

    def refs(row_runs):
        first = jnp.min(jnp.where((row_runs[:, None] == runs.k[None, :]) & val[None, :], idx[None, :], c), axis=1)
        own = _pick(tools.dot, jnp.where(idx[None, :] == first[:, None], 1.0, 0.0), lk0)   # zeros: no key here
        return jnp.where((held & (row_runs == carried.run))[:, None], carried.tau[None, :], own)

    kref, qref = refs(runs.k), refs(runs.q)
    a = jnp.where(val, jnp.max(jnp.where(tools.real[None, :], lk - kref, LOW), axis=1), LOW)
    beta = jnp.max(lq + qref, axis=1)
    fk = jnp.where(val[:, None] & tools.real[None, :], jnp.exp(lk - kref - a[:, None]), 0.0)
    fq = jnp.exp(lq + qref - beta[:, None])
    w = jnp.where(val, jnp.exp(jnp.minimum(a, EXCEEDANCE)), 0.0)
    mask = (idx[:, None] >= idx[None, :]) & (runs.q[:, None] == runs.k[None, :])
    return DocTerms(Terms(a, beta, fq, fk, w, mask), held & (runs.q == carried.run), kref)


def _doc_carry(tools, carried, t, z, lk, val, runs, x: DocTerms, wv):
    """(the carry after the chunk, its t, its z): the state of its last slot's document, on that document's
    running maximum (the carried state continued if it is the carried document, else restarted from the
    chunk's keys)."""
    c = lk.shape[0]
    last = _at(runs.k, c - 1)
    cont = (carried.seen > 0) & (carried.run == last)
    mine = (runs.k == last) & val
    ref = jnp.sum(jnp.where((_iota(c) == c - 1)[:, None], x.kref, 0.0), axis=0)
    tau = jnp.maximum(ref, jnp.max(jnp.where(mine[:, None], lk, LOW), axis=0))
    keep = jnp.exp(ref - tau)
    mk = jnp.where(mine[:, None], x.terms.fk, 0.0)
    t = (jnp.where(cont, t, 0.0) + tools.dot(mk, wv, ta=True)) * keep[:, None]
    z = (jnp.where(cont, z, 0.0) + jnp.sum(mk * x.terms.w[:, None], axis=0)) * keep
    seen = jnp.maximum(jnp.where(cont, carried.seen, 0.0), jnp.max(jnp.where(mine, 1.0, 0.0)))
    return Carried(seen, jnp.where(seen > 0, tau, LOW), last), t, z


def _entering(entering, run_ref):
    """The carry entering the call: keys before the sequence (another device's of a sharded one); τ LOW
    where none."""
    tau = entering.tau[...]
    return Carried(jnp.max(jnp.where(tau > 0.5 * LOW, 1.0, 0.0)), tau, _at(run_ref[...], 0))


def _doc_inputs(tools, q, k, runs, qp, kp, rows):
    """(val, lq, lk, v, the rows' `Runs`) of a chunk."""
    val = _valid(k, rows)
    lq, lk = _log_features(tools, q, qp, rows), _log_features(tools, k.map, kp, rows, val)
    return val, lq, lk, _load(k.v, rows), Runs(runs.q[rows], runs.k[rows])


def _doc_fwd_kernel(q: Side, k: Keys, runs: Runs, entering: State, run_ref, o_ref, lden_ref, refs_ref, a_ref, *,
                    chunk, features, precision):
    """`_causal_fwd_kernel` with documents; refs_ref [N, F] keeps the τ entering each chunk (LOW: the carried
    document has no valid key yet), which with the runs gives the backward pass every reference."""
    tools = _tools(q.proj.shape[1], features, precision, chunk)
    qp, kp = _params(q), _params(k.map)

    def body(i, state):
        carried, t, z = state
        rows = _rows(i, chunk)
        val, lq, lk, v, r = _doc_inputs(tools, q, k, runs, qp, kp, rows)
        x = _doc_terms(tools, lq, lk, val, r, carried)
        y = x.terms
        alpha = jnp.max(jnp.where(y.mask, y.a[None, :], LOW), axis=1)
        alpha = jnp.where(x.reads, jnp.maximum(alpha, 0.0), alpha)
        has = alpha > 0.5 * LOW
        scale = jnp.exp(-jnp.where(has, alpha, 0.0))
        wv = v * y.w[:, None]
        s = jnp.where(y.mask, tools.dot(y.fq, y.fk, tb=True), 0.0)
        fc = jnp.where(x.reads[:, None], y.fq, 0.0)
        num = (tools.dot(fc, t) + tools.dot(s, wv)) * scale[:, None]
        den = (jnp.sum(fc * z[None, :], axis=1) + jnp.sum(s * y.w[None, :], axis=1)) * scale
        o_ref[rows, :] = (num / linear.guard(den, True)[:, None]).astype(o_ref.dtype)
        lden_ref[rows] = jnp.where(has & (den > 0), jnp.log(jnp.maximum(den, 1e-37)) + alpha + y.beta, LOW)
        refs_ref[i, :] = carried.tau
        a_ref[rows] = y.a
        return _doc_carry(tools, carried, t, z, lk, val, r, x, wv)

    init = (_entering(entering, run_ref), entering.t[...], entering.z[...])
    jax.lax.fori_loop(0, _chunks(k.valid, chunk), body, init)


class DocChunk(NamedTuple):
    """What both document backward sweeps read of one chunk (`Chunk` with documents): the carry it entered
    with, rebuilt from the saved τ and the run, and its `DocTerms`."""
    rows: Any
    val: Any
    lk: Any
    v: Any
    runs: Runs
    carried: Carried
    x: DocTerms
    r: Any
    g: Any
    delta: Any


def _doc_chunk(tools, q, k, runs, fwd, qp, kp, i, run):
    rows = _rows(i, tools.chunk)
    val, lq, lk, v, r = _doc_inputs(tools, q, k, runs, qp, kp, rows)
    tau = fwd.refs[i, :]
    carried = Carried(jnp.max(jnp.where(tau > 0.5 * LOW, 1.0, 0.0)), tau, run)
    x = _doc_terms(tools, lq, lk, val, r, carried)
    return DocChunk(rows, val, lk, v, r, carried, x, *_backward_rows(fwd, rows, x.terms.beta, lden_cotangent=True))


def _doc_dq_kernel(q: Side, k: Keys, runs: Runs, entering: State, run_ref, fwd: Forward, dx_ref, drow_ref, *,
                   chunk, features, precision):
    """∂l_q in sequence order, the carried state rebuilt as the forward pass built it."""
    tools = _tools(q.proj.shape[1], features, precision, chunk)
    qp, kp = _params(q), _params(k.map)

    def body(i, state):
        run, t, z = state
        ch = _doc_chunk(tools, q, k, runs, fwd, qp, kp, i, run)
        y = ch.x.terms
        wv = ch.v * y.w[:, None]
        m = jnp.where(y.mask, tools.dot(ch.g, wv, tb=True) - ch.delta[:, None] * y.w[None, :], 0.0)
        held = jnp.where(ch.x.reads[:, None], tools.dot(ch.g, t, tb=True) - ch.delta[:, None] * z[None, :], 0.0)
        dlq = y.fq * ch.r[:, None] * (held + tools.dot(m, y.fk))
        dx_ref[ch.rows, :] = tools.dot(dlq, qp[0], tb=True)
        drow_ref[ch.rows] = jnp.sum(dlq, axis=1)
        carried, t, z = _doc_carry(tools, ch.carried, t, z, ch.lk, ch.val, ch.runs, ch.x, wv)
        return carried.run, t, z

    init = (_entering(entering, run_ref).run, entering.t[...], entering.z[...])
    jax.lax.fori_loop(0, _chunks(k.valid, chunk), body, init)


def _doc_dk_kernel(q: Side, k: Keys, runs: Runs, entering: State, run_ref, fwd: Forward, dx_ref, drow_ref, dv_ref,
                   u_ref, d_ref, *, chunk, features, precision):
    """∂l_k and ∂v in reverse. Entering chunk i, U = Σ exp(l_q(i') + ρ − log den_i')[g_i', −δ_i'] over the
    queries of later chunks in the document of chunk i's last slot, on ρ = the τ entering chunk i + 1 (that
    document's maximum through chunk i, which bounds its keys here); only that document's keys read it.
    What is left after chunk 0 is U of the entering carry's document on its τ: the carry's (T, z)
    cotangent (u_ref, d_ref)."""
    tools = _tools(q.proj.shape[1], features, precision, chunk)
    qp, kp = _params(q), _params(k.map)
    n = _chunks(k.valid, chunk)
    first_run = _entering(entering, run_ref).run

    def body(step, sums):
        i = n - 1 - step
        # the run of the previous chunk's last slot: the document carried into this chunk
        run = jnp.where(i > 0, _at(runs.k[_rows(jnp.maximum(i - 1, 0), chunk)], chunk - 1), first_run)
        ch = _doc_chunk(tools, q, k, runs, fwd, qp, kp, i, run)
        y = ch.x.terms
        rho = jnp.where(i + 1 < n, fwd.refs[jnp.minimum(i + 1, n - 1), :], 0.0)
        last = _at(ch.runs.k, chunk - 1)
        later = (ch.runs.k == last) & ch.val
        ek = jnp.where(later[:, None] & tools.real[None, :], jnp.exp(jnp.minimum(ch.lk - rho[None, :], 0.0)), 0.0)
        fr = _key_grads(tools, ch.rows, y, ch.r, ch.g, ch.delta, ch.v, ek, sums, kp[0], dx_ref, drow_ref, dv_ref)
        # for chunk i − 1's keys: the queries here of the document carried into this chunk (on its entering τ),
        # and the later ones if that document spans this whole chunk
        keep = jnp.where(run == last, jnp.exp(jnp.minimum(ch.carried.tau - rho, 0.0)), 0.0)
        fc = jnp.where(ch.x.reads[:, None], fr, 0.0)
        return Sums(sums.u * keep[:, None] + tools.dot(fc, ch.g, ta=True),
                    sums.d * keep - jnp.sum(fc * ch.delta[:, None], axis=0))

    init = Sums(jnp.zeros(u_ref.shape, F32), jnp.zeros(d_ref.shape, F32))
    u_ref[...], d_ref[...] = jax.lax.fori_loop(0, n, body, init)


def _doc_operands(ops):
    """The document kernels' inputs: the query side, the keys, the runs, the entering state and its run."""
    xq, rq, xk, rk, v, val, qrun, krun, pq, cq, pk, ck, tin, sin, zin, rin = ops
    return [_side(xq, rq, pq, cq), _keys(xk, rk, pk, ck, v, val), Runs(Op(qrun, "valid"), Op(krun, "valid")),
            State(Op(tin, "feat"), Op(sin, "feat_cols"), Op(zin, "feat")), Op(rin, "row_one")]


def _doc_forward(ops, plan):
    b, h, l, _ = ops[0].shape
    dv, f = ops[4].shape[-1], ops[8].shape[-1]
    g = f // plan.block
    outs = [((b, h, g, l, dv), "block"), ((b, h, g, l), "block"), ((b, h, l // plan.chunk, f), "chunk_feat"),
            ((b, h, g, l), "block")]
    o, lden, refs, excess = _call(_doc_fwd_kernel, _doc_operands(ops), outs, (b, h, g, 1), plan)
    out, lden = combine_blocks(o, lden)
    return out, lden, refs, jnp.max(excess, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(16,))
def _doc_core(xq, rq, xk, rk, v, val, qrun, krun, pq, cq, pk, ck, tin, sin, zin, rin, plan):
    """(out, log-denominator, a_j [B, H, L]) of a causal call with documents (one segment), entering with
    the carry (tin [B, H, F] its τ, LOW where none; sin [B, H, F, Dv], zin [B, H, F] its sums on τ; rin [B, 1]
    its document's run) of keys before the sequence; differentiable in the carry's sums."""
    ops = (xq, rq, xk, rk, v, val, qrun, krun, pq, cq, pk, ck, tin, sin, zin, rin)
    out, lden, _, excess = _doc_forward(ops, plan)
    return out, lden, excess


def _doc_core_fwd(xq, rq, xk, rk, v, val, qrun, krun, pq, cq, pk, ck, tin, sin, zin, rin, plan):
    ops = (xq, rq, xk, rk, v, val, qrun, krun, pq, cq, pk, ck, tin, sin, zin, rin)
    out, lden, refs, excess = _doc_forward(ops, plan)
    return (out, lden, excess), (ops, out, lden, refs)


def _doc_core_bwd(plan, residuals, cotangents):
    ops, out, lden, refs = residuals
    g, gl = cotangents[0].astype(F32), cotangents[1].astype(F32)
    xq, rq, xk, rk, v, val, qrun, krun, pq, cq, pk, ck, tin, sin, zin, rin = ops
    b, h, l, dq = xq.shape
    dk, dv, f = xk.shape[3], v.shape[-1], pq.shape[-1]
    nb = f // plan.block
    fwd = Forward(Op(out, "rows"), Op(g, "rows"), Op(lden, "rows"), Op(refs, "chunk_feat"), Op(gl, "rows"))
    inputs = _doc_operands(ops) + [fwd]
    call = functools.partial(_call, inputs=inputs, grid=(b, h, nb, 1), plan=plan)
    dxq, drq = call(_doc_dq_kernel, outs=[((b, h, nb, l, dq), "block"), ((b, h, nb, l), "block")])
    dxk, drk, dvv, dsin, dzin = call(_doc_dk_kernel, outs=[
        ((b, h, nb, l, dk), "block"), ((b, h, nb, l), "block"), ((b, h, nb, l, dv), "block"),
        ((b, h, f, dv), "feat_cols"), ((b, h, f), "feat")])
    dxq, drq, dxk, drk, dvv = (jnp.sum(p, axis=2) for p in (dxq, drq, dxk, drk, dvv))
    zero = lambda a: jnp.zeros_like(a)
    none = lambda a: np.zeros(a.shape, jax.dtypes.float0)       # integer inputs (the runs) take no cotangent
    # the carry's τ is a stabiliser (its sums are on it): no cotangent of its own
    return (dxq.astype(xq.dtype), drq, dxk.astype(xk.dtype), drk, dvv.astype(v.dtype), zero(val), none(qrun),
            none(krun), zero(pq), zero(cq), zero(pk), zero(ck), zero(tin), dsin, dzin, none(rin))


_doc_core.defvjp(_doc_core_fwd, _doc_core_bwd)


def _feature_width(f, block):
    """F padded for the kernel: a power of two up to one feature block, whole blocks beyond (F = 130 runs
    as 192 with blocks of 64, not 256)."""
    return _pow2(f) if f <= block else -(-f // block) * block


def _pow2(n, least=16):
    return max(least, 1 << max(0, (int(n) - 1).bit_length()))


def pad_to(a, axis, size, value=0.0):
    """`a` padded at the end of `axis` to `size` with `value`."""
    axis = axis % a.ndim
    if a.shape[axis] == size:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, pad, constant_values=value)


def feature_params(a, nd):
    """Leading dims of a parameter right-aligned to (batch, head): [.., X] -> [Bp, Hp, X...]."""
    lead = a.ndim - nd
    if lead > 2:
        raise ValueError(f"a feature-map parameter with {lead} leading dims; expected (batch, head) at most")
    return a.reshape((1,) * (2 - lead) + a.shape)


def _padded_map(x, r, p, c, lp, fp):
    """One side's log-linear map padded for the kernel: rows to lp (zeros), D to a power of two (zero
    inputs and projection rows: exact), features to fp (zeros: the kernels mask the features past the
    map's own by their count, `Plan.features`), parameters with (batch, head) dims."""
    dp = _pow2(x.shape[-1])
    return (pad_to(pad_to(x.astype(F32), 3, dp), 2, lp), pad_to(r.astype(F32), 2, lp),
            pad_to(pad_to(feature_params(p.astype(F32), 2), 2, dp), 3, fp),
            pad_to(feature_params(c.astype(F32), 1), 2, fp))


def _padded_values(v, valid, lp):
    """Values padded to lp rows and Dv to a power of two; the key mask as 0/1 floats over lp (padding: 0)."""
    b, lk = v.shape[0], v.shape[2]
    valid = jnp.ones((b, lk), F32) if valid is None else jnp.asarray(valid, bool).astype(F32)
    return pad_to(pad_to(v, 3, _pow2(v.shape[-1])), 2, lp), pad_to(valid, 1, lp)


def precision_name(precision):
    """A PRECISIONS name (None: PRECISION); another is a ValueError naming the valid ones."""
    precision = precision or PRECISION
    if precision not in PRECISIONS:
        raise ValueError(f"unknown kernel precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    return precision


def attend(xq, rq, pq, cq, xk, rk, pk, ck, v, valid=None, causal=False, interpret=None, precision=None,
           segments=None, cut=None, runs=None):
    """Linear attention over log φ_q = xq·pq + cq + rq and log φ_k = xk·pk + ck + rk with the fused
    kernels: xq [B, H, Lq, D], rq [B, H, Lq], xk, rk likewise over Lk, pq/pk [.., D, F] and cq/ck [.., F]
    with leading (batch, head) dims broadcast from the right, v [B, H, Lk, Dv], valid [B, Lk] or None.
    Returns (out [B, H, Lq, Dv] float32, exceeded [B, H, Lq] bool): the rows at or after a causal key that
    exceeded its chunk's reference by more than EXCEEDANCE (in the row's own batch and head; with `runs`,
    its own document), whose output the caller takes from an exact path; every other row's output is
    exact and depends on no such key. Causal needs Lq = Lk. Differentiable in xq, rq, xk, rk, v (not in
    the parameters). `interpret` None: on CPU. `precision`: of the kernel's products (PRECISIONS; None:
    the module's PRECISION). `segments`: the most segments a sequence is split into (None: enough for
    SEGMENT_PROGRAMS programs; the sequence is padded to whole segments). `cut`: (chunk, feature block,
    warps, stages) instead of the mode's and precision's TUNING entry (`bench tune`).
    `runs` [B, L] int32 (favor.attention.documents.runs; Lq = Lk): packed documents, each query seeing
    only the keys of its own run (the document kernels: one segment, `segments` unused)."""
    precision = precision_name(precision)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if runs is not None:
        return packed(xq, rq, pq, cq, xk, rk, pk, ck, v, valid, causal, runs, document_pass,
                      interpret=bool(interpret), precision=precision, cut=cut)
    chunk, block, *launch = cut or tuning(causal, precision)
    b, h, lq, _ = xq.shape
    lk, dv = xk.shape[2], v.shape[-1]
    if causal and lq != lk:
        raise ValueError(f"the fused causal kernel needs Lq = Lk; got {lq} and {lk}")
    f = pq.shape[-1]
    fp = _feature_width(f, block)
    c = min(_pow2(chunk), _pow2(max(lq, lk)))
    plan = Plan(c, min(block, fp), f, bool(interpret), tuple(launch), precision)
    programs = b * h * (fp // plan.block)
    sk, lkp = _segments(lk, c, programs, segments)
    sq, lqp = (sk, lkp) if causal else _segments(lq, c, programs, segments)
    xq, rq, pq, cq = _padded_map(xq, rq, pq, cq, lqp, fp)
    xk, rk, pk, ck = _padded_map(xk, rk, pk, ck, lkp, fp)
    v, valid = _padded_values(v, valid, lkp)
    # parameters are constants of the kernel call (their cotangents are not computed)
    ops = (xq, rq, xk, rk, v, valid, *(jax.lax.stop_gradient(p) for p in (pq, cq, pk, ck)))
    out, excess = _core(*ops, causal, (sq, sk), plan)
    if not causal:                          # the bidirectional passes have no chunk form to exceed
        return out[:, :, :lq, :dv], jnp.zeros((b, h, lq), bool)
    exceeded = linear.cumulative(excess, jnp.maximum, LOW) > EXCEEDANCE
    return out[:, :, :lq, :dv], exceeded[:, :, :lq]


def packed(xq, rq, pq, cq, xk, rk, pk, ck, v, valid, causal, runs, one_pass, **options):
    """`attend` with documents, from `one_pass` (`document_pass` here, favor.attention.tpu's on a TPU, called
    with `options`). Causal: one pass of the document kernels. Bidirectional: that pass and the pass over
    the reversed sequence with its keys shifted by one slot (so each query sees the keys after it),
    combined by their log-denominators: what favor.attention.documents does on XLA, as a state per
    document would need the documents' count, which only the data knows."""
    b, h, l, _ = xq.shape
    if xk.shape[2] != l or runs.shape != (b, l):
        raise ValueError(f"the fused kernel with documents needs Lq = Lk and runs [B, L] = {(b, l)}; got Lq = "
                         f"{l}, Lk = {xk.shape[2]}, runs {tuple(runs.shape)}")
    runs = jnp.asarray(runs, jnp.int32)
    valid = jnp.ones((b, l), bool) if valid is None else jnp.asarray(valid, bool)
    one = functools.partial(one_pass, pq=pq, cq=cq, pk=pk, ck=ck, **options)
    out, lden, exceeded = one(xq, rq, xk=xk, rk=rk, v=v, valid=valid, qrun=runs, krun=runs)
    if causal:
        return out, exceeded
    flip = lambda a, axis=2: jnp.flip(a, axis=axis)
    # slot j of the reversed pass holds reversed key j − 1 (slot 0 no key): causal j ≤ i is then "after i"
    shift = lambda a, axis=2: jax.lax.slice_in_dim(_pad_front(a, axis), 0, l, axis=axis)
    back = documents.reversed_runs(runs)
    out2, lden2, exceeded2 = one(flip(xq), flip(rq), xk=shift(flip(xk)), rk=shift(flip(rk)), v=shift(flip(v)),
                                 valid=shift(flip(valid, 1), 1), qrun=back, krun=documents.shifted_runs(back, 1))
    out, _ = combine_blocks(jnp.stack([out, flip(out2)], 2), jnp.stack([lden, flip(lden2)], 2))
    return out, exceeded | flip(exceeded2)


def document_pass(xq, rq, pq, cq, xk, rk, pk, ck, v, valid, qrun, krun, carry=None, interpret=None, precision=None,
                  cut=None):
    """One causal pass of the document kernels: query i sees the keys j ≤ i with krun_j = qrun_i (shapes as
    in `attend`, Lq = Lk; qrun, krun [B, L] int32 runs, non-decreasing), entering with `carry`, the
    state of keys before the sequence as favor.attention.documents.summary gives it — (seen [B, H],
    τ [B, H, F], T [B, H, F, Dv + 1] on τ, run [B]; a τ above its keys is restated: `on_its_keys`) — or
    None. Returns (out [B, H, L, Dv] float32,
    log-denominator [B, H, L] (LOW: no key), exceeded [B, H, L] as `attend`'s: the rows at or after a key of
    their document beyond the bound). Differentiable in xq, rq, xk, rk, v and the carry's T (its τ is a
    stabiliser)."""
    precision = precision_name(precision)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    chunk, block, *launch = cut or tuning(True, precision)
    b, h, l, _ = xq.shape
    dv, f = v.shape[-1], pq.shape[-1]
    fp = _feature_width(f, block)
    c = min(_pow2(chunk), _pow2(l))
    lp = -(-l // c) * c
    plan = Plan(c, min(block, fp), f, bool(interpret), tuple(launch), precision)
    xq, rq, pq, cq = _padded_map(xq, rq, pq, cq, lp, fp)
    xk, rk, pk, ck = _padded_map(xk, rk, pk, ck, lp, fp)
    v, valid = _padded_values(v, valid, lp)
    dvp = v.shape[-1]
    qrun, krun = (pad_to(jnp.asarray(r, jnp.int32), 1, lp, linear.NO_RUN) for r in (qrun, krun))
    if carry is None:
        tin, sin = jnp.full((b, h, fp), LOW, F32), jnp.zeros((b, h, fp, dvp), F32)
        zin, rin = jnp.zeros((b, h, fp), F32), jnp.full((b, 1), linear.NO_RUN, jnp.int32)
    else:
        seen, tau, total, run = on_its_keys(carry)
        tin = pad_to(jnp.where(seen[..., None], jax.lax.stop_gradient(tau).astype(F32), LOW), 2, fp, LOW)
        sin = pad_to(pad_to(total[..., :dv].astype(F32), 3, dvp), 2, fp)
        zin = pad_to(total[..., dv].astype(F32), 2, fp)
        rin = jnp.asarray(run, jnp.int32)[:, None]
    params = (jax.lax.stop_gradient(p) for p in (pq, cq, pk, ck))
    out, lden, excess = _doc_core(xq, rq, xk, rk, v, valid, qrun, krun, *params, tin, sin, zin, rin, plan)
    # a key's excess reaches the later rows of its own document (the key runs lag the query runs by a shift)
    reach = linear.segmented(excess, krun[:, None], jnp.maximum, LOW)
    exceeded = jnp.where((qrun == krun)[:, None], reach, LOW) > EXCEEDANCE
    return out[:, :, :l, :dv], lden[:, :, :l], exceeded[:, :, :l]


def on_its_keys(carry):
    """The carry (seen, τ, T, run) restated so that τ_f reaches no higher than its keys' largest log-feature:
    where z_f = T[.., f, Dv] < 1 (τ_f above them: the same sums on another τ, though not what
    documents.summary gives), on τ_f + log z_f, where z_f = 1. The kernels clamp a row's ratio β_i − log den_i
    at 0 on the premise that the keys reach their τ; above it the outputs stay right but the gradients do
    not. The factor is a constant of the call (the carry's τ is a stabiliser)."""
    seen, tau, total, run = carry
    z = total[..., -1].astype(F32)
    shift = jax.lax.stop_gradient(jnp.where((z > 0) & (z < 1), jnp.log(jnp.where(z > 0, z, 1.0)), 0.0))
    return seen, jax.lax.stop_gradient(tau).astype(F32) + shift, total.astype(F32) * jnp.exp(-shift)[..., None], run


def _pad_front(a, axis):
    pad = [(0, 0)] * a.ndim
    pad[axis] = (1, 0)
    return jnp.pad(a, pad)


def prefill(xk, rk, pk, ck, v, valid=None, interpret=None, segments=None, precision=None, cut=None):
    """The decoding state after keys log φ_k = xk·pk + ck + rk and values v (shapes as in `attend`),
    computed by the key-state kernel: (τ [B, H, F], the per-feature key maximum, −inf where no valid key;
    Σ_j exp(l_k(j) − τ)[v_j, 1] [B, H, F, Dv + 1]), decoding.decode_prefill's "tau" and "sum". Not
    differentiable (a prompt's prefill). Cut and launched as a bidirectional call (TUNING; `cut` as in
    `attend`)."""
    precision = precision_name(precision)
    chunk, block, *launch = cut or tuning(False, precision)
    b, h, lk, _ = xk.shape
    dv, f = v.shape[-1], pk.shape[-1]
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    fp = _feature_width(f, block)
    c = min(_pow2(chunk), _pow2(lk))
    plan = Plan(c, min(block, fp), f, bool(interpret), tuple(launch), precision)
    seg, lkp = _segments(lk, c, b * h * (fp // plan.block), segments)
    xk, rk, pk, ck = _padded_map(xk, rk, pk, ck, lkp, fp)
    v, valid = _padded_values(v, valid, lkp)
    ops = tuple(jax.lax.stop_gradient(a) for a in (xk, rk, v, valid, pk, ck))
    xk, rk, v, valid, pk, ck = ops
    states = _call(_key_state_kernel, [_keys(xk, rk, pk, ck, v, valid)], _state_outs(b, h, seg, fp, v.shape[-1]),
                   (b, h, fp // plan.block, seg), plan)
    tau, t, z = _total(*states)
    tau, t, z = tau[..., :f], t[..., :f, :dv], z[..., :f]
    return jnp.where(tau > 0.5 * LOW, tau, -jnp.inf), jnp.concatenate([t, z[..., None]], -1)
