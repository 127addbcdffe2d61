"""Random-feature attention kernels for TPUs: the passes of favor.attention.fused, written for Mosaic (Pallas' TPU
lowering) instead of Triton. Same contracts (`attend`, `document_pass`, `prefill`), same maps, math and
stabilisers; read fused.py's docstring for them. In brief: each feature map is a log-linear form log φ(u) = u·P +
c + r(u); for a block of features a program forms the [chunk, F] log-features of its rows in VMEM and never
writes an [L, F] array.

- bidirectional: a key pass with a running per-feature maximum τ (the state T = Σ_j exp(l_k(j) − τ)[v_j, 1]
  rescaled whenever τ grows), then a query pass with exp(l_q(i) + τ − β_i), β_i = max_f(l_q(i, f) + τ_f).
- causal: the chunk form, chunk after chunk: a reference τ0 per chunk (the carried τ, or the chunk's first valid
  key before any key was seen), a_j = max_f(l_k(j, f) − τ0_f), key weights e^min(a_j, EXCEEDANCE), a divisor
  α_i = max_{j ≤ i} a_j (≥ 0 once a key came before the chunk), the in-chunk part a masked [c, c] product and
  the earlier chunks through the carried state. Every a_j is written out; `attend` flags the rows at or after
  a key whose a_j exceeds EXCEEDANCE (the caller takes those rows from its exact path).
- backward: a custom VJP with kernels of its own, the stabilisers constants. With h_i = [g_i, −g_i·o_i]/den_i,
  ∂l_q(i) = φ_q(i) Σ_{j≤i} φ_k(j)[v_j, 1]·h_i, ∂l_k(j) = φ_k(j)[v_j, 1]·Σ_{i≥j} φ_q(i) h_i and ∂v_j likewise:
  causal, a forward sweep from the prefix state (∂l_q) and a reverse sweep with the suffix sums U (∂l_k, ∂v);
  bidirectional, a query sweep that also sums U, then every key chunk in parallel. P and c get no gradient.

How Mosaic runs it
------------------
Grid (B, H, G, N): batch, head, block of `block` features, chunk of `chunk` rows. The first three are "parallel"
(megacore may split them); N is "arbitrary" (sequential, the last and fastest axis) where a kernel carries a
state from chunk to chunk, and the carry lives in VMEM scratch (`pltpu.VMEM`), set at the first chunk
(`pl.when(pl.program_id(3) == 0)`). Each program sees 2-D blocks, the batch/head/block dims squeezed (`None`):
  rows         [B, H, L, X] -> [chunk, X]       inputs x [., D'], values [., Dv'], r and log-denominator [., 1]
  mask, run    [B, L, 1]    -> [chunk, 1]       which keys are valid (0/1); documents: int32 runs per row
  run_row      [B, N, 1, chunk] -> [1, chunk]   documents: a chunk's runs as a row (for the [chunk, chunk] masks)
  feat         [B', H', X, F'] -> [X, block]    P [D', F'], c [1, F'], the state τ [1, F'], S [Dv', F'], z [1, F']
  block_rows   [B, H, G, L, X] -> [chunk, X]    per-feature-block outputs (summed / combined by the wrapper)
  chunk_feat   [B, H, N, 1, F'] -> [1, block]   each chunk's reference τ0 (causal)
Every block's last two dims are multiples of (8, 128) or the array's own: D, Dv and F are padded to multiples of
128 lanes (D', Dv', F'; zero inputs and projections, exact), chunks are multiples of 8 rows (a cut's chunk that
is a multiple of 128 stays one for short sequences, so the [chunk, chunk] tiles fill whole lanes). A padded
feature is masked by its index (`_real`), never by a value it holds: it sets no maximum and weighs nothing.

Layouts that keep Mosaic on its well-trodden paths: a per-row vector (r, log-denominator, a_j, β, δ) is a
[chunk, 1] column and a per-feature vector (τ, z, c) a [1, block] row; every reduction reduces a 2-D tile and
keeps its dims (none reduces a [chunk, 1] column to [1, 1]: the causal carry's "a key came before" is itself a
[chunk, 1] column, and the chunk's first valid key is found per feature); every boolean mask is formed in its
full shape from iotas or broadcast floats (Mosaic relayouts no broadcast i1 vector). The state is stored
transposed, S = Tᵀ [Dv', block] (and the backward sums U likewise), so a per-feature rescale is a row broadcast.
The products are NN or NT (`dot_general` contracting the last dims, the MXU's native forms); the TN products
(the updates Sᵀ += vᵀ·f and Uᵀ += gᵀ·f) transpose their [chunk, Dv'] operand explicitly (`.T`, as Pallas' TPU
flash attention does). A per-key column needed as a row ([1, chunk], to weigh the columns of a [chunk, chunk]
tile) is taken off the diagonal by a masked reduction (`_as_row`), exact, with no transpose of a [chunk, 1]
vector; the reverse sweep forms its [chunk, chunk] tiles with the keys along the sublanes, so it needs no
transposed tile either.

Checked on CPU only: interpret mode (pltpu.InterpretParams) for the numbers, jax.export(platforms=["tpu"]) for
the lowering to Mosaic, which checks the blocks' tiling and that every operation has a Mosaic lowering; Mosaic's
own layout passes and compilation run only on a TPU and have not run.

Precision (a static `Plan` field, as in fused.py): interpret mode (CPU) runs Precision.HIGHEST. On a TPU the
fused.PRECISIONS name maps to what Mosaic's matmul offers (MOSAIC_PRODUCTS): float32 operands at
Precision.HIGHEST (contract precision fp32: float32-level products from several bf16 MXU passes) for "highest"
and for "tf32x3" (Mosaic has no three-pass preset; the GPU default asks for float32-level products, which this
is), and bf16 operands with float32 accumulation (one MXU pass) for "bf16".

Packed documents (`document_pass`, fused.document_pass's contract and reference rule: each row on its own
document's stabilisers, the carry read only by the carried document's queries) and the prefill (`prefill`, the
key-state kernel) are here too; a bidirectional call with documents is two document passes combined by their
log-denominators, as fused's.

No segments: the Triton kernels cut a long sequence into segments that run in parallel (fused._segments); these
do not, because a TPU core runs the grid's iterations in sequence. The (batch, head, feature block) axes are
"parallel" and are what megacore splits, so segments would add a fold of their states and no parallelism.
Chunk and feature block are unmeasured defaults (TUNING).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from favor.attention import linear
from favor.attention.fused import (EXCEEDANCE, LOW, PRECISIONS, combine_blocks, feature_params, on_its_keys, pad_to,
                                   precision_name)

F32 = jnp.float32
LANES = 128       # a vreg's lanes: D, Dv and F pad to multiples of it
SUBLANES = 8      # a vreg's sublanes: chunks are multiples of it
HIGHEST = jax.lax.Precision.HIGHEST

# The kernels' products on a TPU by fused.PRECISIONS name: "fp32" = float32 operands at Precision.HIGHEST,
# "bf16" = bf16 operands, float32 accumulation. Interpret mode always runs "fp32".
MOSAIC_PRODUCTS = {"highest": "fp32", "tf32x3": "fp32", "bf16": "bf16"}

# (tokens per chunk, features per block) by mode: unmeasured starting points (no TPU measurement yet). A causal
# chunk of 128 fills the lanes of the [chunk, chunk] in-chunk tile; the bidirectional passes have no such tile.
TUNING = {"causal": (128, 256), "bidirectional": (256, 256)}


# -- operand groups ----------------------------------------------------------------------------------------
# pallas_call takes pytrees of operands and of BlockSpecs and hands the kernel its refs in the same structure.
# Each group names the layout (`_spec`) of its fields in `kinds`.
class Map(NamedTuple):
    """One side's log-linear map log φ = x·P + c + r: rows x [c, D'] and r [c, 1]; P [D', block], c [1, block]."""
    x: Any
    r: Any
    p: Any
    c: Any
    kinds = ("rows", "rows", "feat", "feat")


class Values(NamedTuple):
    """The keys' values v [c, Dv'] and their mask [c, 1] (1: a valid key)."""
    v: Any
    valid: Any
    kinds = ("rows", "mask")


class State(NamedTuple):
    """A key state on its reference τ [1, block]: S = Tᵀ = Σ_j v_j exp(l_k(j) − τ)ᵀ [Dv', block], z [1, block]."""
    tau: Any
    s: Any
    z: Any
    kinds = ("feat", "feat", "feat")


class Carry(NamedTuple):
    """The causal forward pass's carry (VMEM scratch): whether a valid key came before (0/1 in each of [c, 1]'s
    rows), and the State (τ LOW until the first valid key)."""
    seen: Any
    tau: Any
    s: Any
    z: Any


class Sums(NamedTuple):
    """The query sums of the key gradients, U = Σ_i exp(l_q(i) + ρ − log den_i)[g_i, −δ_i] on a reference ρ,
    stored as ug = [Dv', block] (the g part, transposed) and ud [1, block]."""
    ug: Any
    ud: Any
    kinds = ("feat", "feat")


class Rows(NamedTuple):
    """A forward pass's outputs for its feature block: o [c, Dv'] normalised over the block, log-denominator [c, 1]."""
    o: Any
    lden: Any
    kinds = ("block_rows", "block_rows")


class CausalRows(NamedTuple):
    """The causal forward pass's outputs: Rows, each chunk's reference τ0 [1, block] and each key's a_j [c, 1]."""
    o: Any
    lden: Any
    tau: Any
    a: Any
    kinds = ("block_rows", "block_rows", "chunk_feat", "block_rows")


class Tau(NamedTuple):
    """The key reference τ [1, block] alone."""
    tau: Any
    kinds = ("feat",)


class Cotangent(NamedTuple):
    """What the backward passes read of the forward pass, per row: the output o [c, Dv'] and its cotangent g, and
    the log-denominator over all features [c, 1]."""
    o: Any
    g: Any
    lden: Any
    kinds = ("rows", "rows", "rows")


class References(NamedTuple):
    """The causal backward's references: the chunk's τ0 and the next chunk's (ρ of the reverse sweep; the last
    chunk its own)."""
    tau: Any
    rho: Any
    kinds = ("chunk_feat", "chunk_feat")


class InputGrads(NamedTuple):
    """∂/∂x [c, D'] and ∂/∂r [c, 1] of one side's map (this feature block's share)."""
    dx: Any
    dr: Any
    kinds = ("block_rows", "block_rows")


class KeyGrads(NamedTuple):
    dx: Any
    dr: Any
    dv: Any
    kinds = ("block_rows", "block_rows", "block_rows")


class Plan(NamedTuple):
    """How a call is cut and run, static: rows per chunk, features per block, the map's own feature count (the
    padded width past it holds no feature), interpret mode, and the products (MOSAIC_PRODUCTS' "fp32"/"bf16")."""
    chunk: int
    block: int
    features: int
    interpret: bool
    products: str


# -- in-kernel tools ---------------------------------------------------------------------------------------
class Products(NamedTuple):
    """The kernel's matrix products at the plan's precision: a·b, a·bᵀ and aᵀ·b, float32 results."""
    nn: Any
    nt: Any
    tn: Any


def _products(products):
    """Products at "fp32" (float32 operands, Precision.HIGHEST) or "bf16" (bf16 operands, default precision), both
    accumulating in float32. aᵀ·b transposes a explicitly (its [chunk, X] operand: both dims whole tiles)."""
    low = products == "bf16"

    def dot(a, b, b_contracts):
        if low:
            a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        return jax.lax.dot_general(a, b, (((1,), (b_contracts,)), ((), ())), precision=None if low else HIGHEST,
                                   preferred_element_type=F32)

    return Products(nn=lambda a, b: dot(a, b, 0), nt=lambda a, b: dot(a, b, 1), tn=lambda a, b: dot(a.T, b, 0))


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _real(plan):
    """[chunk, block]: which features of the program's block are the map's own (the first `features` of F').
    Every mask in these kernels is formed in its full shape: Mosaic relayouts no broadcast boolean vector."""
    return pl.program_id(2) * plan.block + _iota((plan.chunk, plan.block), 1) < plan.features


def _spread(flags, shape):
    """A 0/1 float column [c, 1] or row [1, X] as a boolean mask of `shape`: the float broadcast, then compared."""
    return jnp.broadcast_to(flags, shape) > 0


def _log_features(mm, side, real):
    """[c, D'] rows -> [c, block] log-features x·P + c + r; LOW in the padded features."""
    return jnp.where(real, mm.nn(side.x[...], side.p[...]) + side.c[...] + side.r[...], LOW)


def _key_features(mm, keys, values, real):
    """The keys' log-features (LOW for padded keys and features), their validity [c, 1] and `live` [c, block]: a
    valid key's real features."""
    valid = values.valid[...]
    live = _spread(valid, real.shape) & real
    return jnp.where(_spread(valid, real.shape), _log_features(mm, keys, real), LOW), valid > 0, live


def _as_row(col):
    """[c, 1] -> [1, c], exactly: the diagonal of the column broadcast over the lanes, summed over the sublanes."""
    c = col.shape[0]
    return jnp.sum(jnp.where(_iota((c, c), 0) == _iota((c, c), 1), col, 0.0), axis=0, keepdims=True)


def _log_den(den, shift):
    return jnp.where(den > 0, jnp.log(jnp.maximum(den, 1e-37)) + shift, LOW)


def _at_first_chunk(init):
    pl.when(pl.program_id(3) == 0)(init)


def _at_last_chunk(finish):
    pl.when(pl.program_id(3) == pl.num_programs(3) - 1)(finish)


def _start_state(state):
    state.tau[...] = jnp.full(state.tau.shape, LOW, F32)
    state.s[...] = jnp.zeros(state.s.shape, F32)
    state.z[...] = jnp.zeros(state.z.shape, F32)


def _start_sums(sums):
    sums.ug[...] = jnp.zeros(sums.ug.shape, F32)
    sums.ud[...] = jnp.zeros(sums.ud.shape, F32)


def _ratio_to_den(beta, lden):
    """r_i = exp(β_i − log den_i) (0 for a row with no key). β_i ≤ log den_i wherever the pass is exact; the clamp
    keeps r finite in a causal row beyond the bound (taken from the exact path; its cotangent here is 0)."""
    return jnp.exp(jnp.where(lden > 0.5 * LOW, jnp.minimum(beta - lden, 0.0), LOW))


# -- bidirectional -----------------------------------------------------------------------------------------
def _key_state_kernel(keys, values, out, carry, *, plan):
    """(τ, S, z) over every key: the running per-feature maximum τ (LOW where no valid key) and
    S = Σ_j v_j exp(l_k(j) − τ)ᵀ, z = Σ_j exp(l_k(j) − τ), every factor ≤ 1."""
    mm, real = _products(plan.products), _real(plan)
    _at_first_chunk(lambda: _start_state(carry))
    lk, _, live = _key_features(mm, keys, values, real)
    tau = carry.tau[...]
    new = jnp.maximum(tau, jnp.max(lk, axis=0, keepdims=True))
    keep = jnp.exp(tau - new)
    fk = jnp.where(live, jnp.exp(lk - new), 0.0)
    carry.s[...] = carry.s[...] * keep + mm.tn(values.v[...], fk)
    carry.z[...] = carry.z[...] * keep + jnp.sum(fk, axis=0, keepdims=True)
    carry.tau[...] = new

    def finish():
        out.tau[...], out.s[...], out.z[...] = carry.tau[...], carry.s[...], carry.z[...]
    _at_last_chunk(finish)


def _query_factors(mm, queries, tau, real):
    """β_i = max_f(l_q(i, f) + τ_f) [c, 1] and fq = exp(l_q + τ − β) [c, block] (≤ 1, 1 where β is reached)."""
    lq = _log_features(mm, queries, real)
    beta = jnp.max(lq + tau, axis=1, keepdims=True)
    return beta, jnp.exp(lq + tau - beta)


def _bidir_fwd_kernel(queries, state, out, *, plan):
    """A query chunk against the state of every key: the denominator is ≥ 1 on β's scale."""
    mm, real = _products(plan.products), _real(plan)
    beta, fq = _query_factors(mm, queries, state.tau[...], real)
    den = jnp.sum(fq * state.z[...], axis=1, keepdims=True)
    out.o[...] = mm.nt(fq, state.s[...]) / linear.guard(den, True)
    out.lden[...] = _log_den(den, beta)


def _bidir_dq_kernel(queries, fwd, state, out, sums_out, sums, *, plan):
    """∂l_q = fr·(g·T − δ z) with fr = exp(l_q + τ − log den), and the sums U = Σ_i fr_i [g_i, −δ_i] over every
    query (on the key reference τ), which the key kernel reads."""
    mm, real = _products(plan.products), _real(plan)
    _at_first_chunk(lambda: _start_sums(sums))
    beta, fq = _query_factors(mm, queries, state.tau[...], real)
    fr = fq * _ratio_to_den(beta, fwd.lden[...])
    g = fwd.g[...]
    delta = jnp.sum(g * fwd.o[...], axis=1, keepdims=True)
    dlq = fr * (mm.nn(g, state.s[...]) - delta * state.z[...])
    out.dx[...] = mm.nt(dlq, queries.p[...])
    out.dr[...] = jnp.sum(dlq, axis=1, keepdims=True)
    sums.ug[...] += mm.tn(g, fr)
    sums.ud[...] -= jnp.sum(fr * delta, axis=0, keepdims=True)

    def finish():
        sums_out.ug[...], sums_out.ud[...] = sums.ug[...], sums.ud[...]
    _at_last_chunk(finish)


def _bidir_dk_kernel(keys, values, tau, sums, out, *, plan):
    """∂l_k = ek·(v·U_g + U_d), ∂v = ek·U_gᵀ with ek = exp(l_k − τ) ≤ 1: every key chunk on its own."""
    mm, real = _products(plan.products), _real(plan)
    lk, _, live = _key_features(mm, keys, values, real)
    ek = jnp.where(live, jnp.exp(jnp.minimum(lk - tau.tau[...], 0.0)), 0.0)
    ug = sums.ug[...]
    dlk = ek * (mm.nn(values.v[...], ug) + sums.ud[...])
    out.dv[...] = mm.nt(ek, ug)
    out.dx[...] = mm.nt(dlk, keys.p[...])
    out.dr[...] = jnp.sum(dlk, axis=1, keepdims=True)


# -- causal ------------------------------------------------------------------------------------------------
class Chunk(NamedTuple):
    """A chunk's stabilised factors on its reference τ0 (fused._causal_terms): a_j [c, 1] (LOW for padding),
    β_i [c, 1], fq = exp(l_q + τ0 − β), fk = exp(l_k − τ0 − a) (0 for padded keys and features), key weights
    w = e^min(a, EXCEEDANCE) [c, 1] and as a row [1, c], the mask j ≤ i [c, c]; and l_k, `live`, v."""
    lk: Any
    live: Any
    v: Any
    a: Any
    beta: Any
    fq: Any
    fk: Any
    w: Any
    w_row: Any
    a_row: Any
    tri: Any


def _reference(lk, live, tau):
    """τ0 [1, block]: the carried τ once a valid key came before (the carry is LOW until the first key: τ > LOW/2),
    else the chunk's first valid key (every query that sees a key sees that one); LOW while no key at all, and
    in the padded features."""
    rows = _iota(lk.shape, 0).astype(F32)
    first = jnp.min(jnp.where(live, rows, float(lk.shape[0])), axis=0, keepdims=True)
    anchor = jnp.max(jnp.where(rows == first, lk, LOW), axis=0, keepdims=True)
    return jnp.where(tau > 0.5 * LOW, tau, anchor)


def _chunk(mm, queries, keys, values, tau0, real, keyed=None):
    """The chunk's factors; `keyed`: the keys' (l_k, valid, live) if already formed."""
    keyed = keyed or _key_features(mm, keys, values, real)
    c = real.shape[0]
    tri = _iota((c, c), 0) >= _iota((c, c), 1)
    return _factors(_log_features(mm, queries, real), keyed, values.v[...], tau0, tau0, tri, real)


def _factors(lq, keyed, v, kref, qref, tri, real):
    """`Chunk` of the chunk's log-features on the keys' references kref and the queries' qref: [1, block], one
    reference for every row, or [c, block], each row its own (documents)."""
    lk, valid, live = keyed
    a = jnp.where(valid, jnp.max(jnp.where(real, lk - kref, LOW), axis=1, keepdims=True), LOW)
    beta = jnp.max(lq + qref, axis=1, keepdims=True)
    fk = jnp.where(live, jnp.exp(lk - kref - a), 0.0)
    fq = jnp.exp(lq + qref - beta)
    w = jnp.where(valid, jnp.exp(jnp.minimum(a, EXCEEDANCE)), 0.0)
    a_row = _as_row(a)
    w_row = jnp.exp(jnp.minimum(a_row, EXCEEDANCE))            # a padded key's a_j = LOW: weight 0
    return Chunk(lk, live, v, a, beta, fq, fk, w, w_row, a_row, tri)


def _advance(mm, ch, tau0, s, z):
    """The state after the chunk's keys, on the new running maximum max(τ0, max_j l_k(j))."""
    new = jnp.maximum(tau0, jnp.max(ch.lk, axis=0, keepdims=True))
    keep = jnp.exp(tau0 - new)
    return new, (s + mm.tn(ch.v * ch.w, ch.fk)) * keep, (z + jnp.sum(ch.fk * ch.w, axis=0, keepdims=True)) * keep


def _attend_chunk(mm, ch, reads, s, z):
    """(o [c, Dv'], log-denominator [c, 1]) of a chunk's rows: the in-chunk pairs (`ch.tri`) and, for the rows
    that read it (`reads` [c, 1], 0/1: a key came before them), the carried state (S, z), all divided by e^α_i,
    α_i = max(0 if the row reads the state, max over its in-chunk keys a_j): the row's own causal divisor."""
    alpha = jnp.max(jnp.where(ch.tri, ch.a_row, LOW), axis=1, keepdims=True)
    alpha = jnp.where(reads > 0, jnp.maximum(alpha, 0.0), alpha)
    has = alpha > 0.5 * LOW
    scale = jnp.exp(-jnp.where(has, alpha, 0.0))
    pairs = jnp.where(ch.tri, mm.nt(ch.fq, ch.fk), 0.0)
    fc = jnp.where(_spread(reads, ch.fq.shape), ch.fq, 0.0)
    num = (mm.nt(fc, s) + mm.nn(pairs, ch.v * ch.w)) * scale
    den = (jnp.sum(fc * z, axis=1, keepdims=True) + jnp.sum(pairs * ch.w_row, axis=1, keepdims=True)) * scale
    # log of the true denominator Σ_j φ_q(i)·φ_k(j): what the backward pass divides by
    return num / linear.guard(den, True), jnp.where(has, _log_den(den, alpha + ch.beta), LOW)


def _causal_fwd_kernel(queries, keys, values, out, carry, *, plan):
    """One chunk of the causal pass: its rows from the carried state (the earlier chunks' keys) and the masked
    in-chunk product, both divided by e^α_i; writes τ0 and each a_j, then carries the state past the chunk."""
    mm, real = _products(plan.products), _real(plan)

    def start():
        carry.seen[...] = jnp.zeros(carry.seen.shape, F32)
        _start_state(carry)
    _at_first_chunk(start)
    seen = carry.seen[...]
    keyed = _key_features(mm, keys, values, real)
    tau0 = _reference(keyed[0], keyed[2], carry.tau[...])
    ch = _chunk(mm, queries, keys, values, tau0, real, keyed)
    out.o[...], out.lden[...] = _attend_chunk(mm, ch, seen, carry.s[...], carry.z[...])
    out.tau[...] = tau0
    out.a[...] = ch.a
    carry.tau[...], carry.s[...], carry.z[...] = _advance(mm, ch, tau0, carry.s[...], carry.z[...])
    # whether a valid key came before the next chunk, in every row (a [c, c] reduction: no [c, 1] -> [1, 1] one)
    any_valid = jnp.max(jnp.broadcast_to(_as_row(values.valid[...]), ch.tri.shape), axis=1, keepdims=True)
    carry.seen[...] = jnp.maximum(seen, any_valid)


def _causal_dq_kernel(queries, keys, values, fwd, refs, out, state, *, plan):
    """∂l_q in sequence order from the prefix state, rebuilt chunk by chunk as the forward pass built it."""
    mm, real = _products(plan.products), _real(plan)
    _at_first_chunk(lambda: _start_state(state))
    tau0 = refs.tau[...]
    ch = _chunk(mm, queries, keys, values, tau0, real)
    r = _ratio_to_den(ch.beta, fwd.lden[...])
    g = fwd.g[...]
    delta = jnp.sum(g * fwd.o[...], axis=1, keepdims=True)
    m = jnp.where(ch.tri, mm.nt(g, ch.v * ch.w) - delta * ch.w_row, 0.0)
    dlq = ch.fq * r * (mm.nn(g, state.s[...]) - delta * state.z[...] + mm.nn(m, ch.fk))
    out.dx[...] = mm.nt(dlq, queries.p[...])
    out.dr[...] = jnp.sum(dlq, axis=1, keepdims=True)
    _, state.s[...], state.z[...] = _advance(mm, ch, tau0, state.s[...], state.z[...])


def _key_grads(mm, ch, later, r, g, delta, ek, ug, ud, p, out):
    """Writes ∂x, ∂r and ∂v of a chunk's keys: from the later chunks' query sums (ug, ud on ρ, through
    ek = exp(l_k − ρ)) and from the chunk's own queries, the pairs `later` [j, i] (keys j along the sublanes,
    queries i along the lanes: no transposed tile); returns fr = fq·r, the chunk's queries' share of the sums."""
    fr = ch.fq * r
    # b_t[j, i] = g_i·v_j − δ_i and s_t[j, i] = fk_j·fq_i for the pairs
    b_t = jnp.where(later, mm.nt(ch.v, g) - _as_row(delta), 0.0)
    s_t = jnp.where(later, mm.nt(ch.fk, ch.fq), 0.0)
    dlk = ek * (mm.nn(ch.v, ug) + ud) + ch.fk * ch.w * mm.nn(b_t, fr)
    out.dv[...] = mm.nt(ek, ug) + ch.w * mm.nn(s_t, g * r)
    out.dx[...] = mm.nt(dlk, p)
    out.dr[...] = jnp.sum(dlk, axis=1, keepdims=True)
    return fr


def _causal_dk_kernel(queries, keys, values, fwd, refs, out, sums, *, plan):
    """∂l_k and ∂v in reverse (the grid's step i is chunk N − 1 − i): U = Σ over the later chunks' queries of
    exp(l_q(i) + ρ − log den_i)[g_i, −δ_i] on ρ = the next chunk's reference, which bounds every key here."""
    mm, real = _products(plan.products), _real(plan)
    _at_first_chunk(lambda: _start_sums(sums))
    tau0, rho = refs.tau[...], refs.rho[...]
    ch = _chunk(mm, queries, keys, values, tau0, real)
    r = _ratio_to_den(ch.beta, fwd.lden[...])
    g = fwd.g[...]
    delta = jnp.sum(g * fwd.o[...], axis=1, keepdims=True)
    ek = jnp.where(ch.live, jnp.exp(jnp.minimum(ch.lk - rho, 0.0)), 0.0)
    later = _iota(ch.tri.shape, 1) >= _iota(ch.tri.shape, 0)
    ug, ud = sums.ug[...], sums.ud[...]
    fr = _key_grads(mm, ch, later, r, g, delta, ek, ug, ud, keys.p[...], out)
    keep = jnp.exp(jnp.minimum(tau0 - rho, 0.0))
    sums.ug[...] = ug * keep + mm.tn(g, fr)
    sums.ud[...] = ud * keep - jnp.sum(fr * delta, axis=0, keepdims=True)


# -- packed documents --------------------------------------------------------------------------------------
# fused.py's "packed documents" section on Mosaic, the same rule: a query sees the keys ≤ it of its own run
# (`qrun`, `krun`: int32 runs, the queries' and the keys' apart), every stabiliser its document's own. The carry
# is the state of the document of the key slot before the chunk, read only by the chunk's queries of that
# document, and restarted where the chunk's last slot belongs to another. Mosaic extracts no scalar from a
# vector, so the wrapper hands every row of a chunk the run carried into it and the run of its last slot
# (`DocRuns.enter`, `.last`), and whether the carried document has a key is read off its τ (LOW until then).
class DocRuns(NamedTuple):
    """Each row's document as int32 runs: the queries' and the keys' as columns [c, 1] and as rows [1, c] (a
    [c, c] mask pairs one side's column with the other's row); and, the same in every row of the chunk, the run
    carried into it (its slot before the chunk's; the entering carry's for the first chunk) and the run of its
    last key slot, the document it hands on (columns [c, 1])."""
    q: Any
    k: Any
    q_row: Any
    k_row: Any
    enter: Any
    last: Any
    kinds = ("run", "run", "run_row", "run_row", "run", "run")


class DocCotangent(NamedTuple):
    """`Cotangent` with the log-denominator's own cotangent gl [c, 1] (a bidirectional call combines two passes
    by their log-denominators)."""
    o: Any
    g: Any
    lden: Any
    gl: Any
    kinds = ("rows", "rows", "rows", "rows")


class DocChunk(NamedTuple):
    """A chunk's factors with documents (fused._doc_terms): `Chunk`, each row on its own document's reference
    and `tri` the pairs a query sees (j ≤ i, one document); the keys' validity [c, 1] (0/1), their references
    kref [c, block], whether the carried document has a key (`held`) and which queries read the carried state
    (`reads`; both [c, 1], 0/1)."""
    ch: Chunk
    valid: Any
    kref: Any
    held: Any
    reads: Any


def _flag(cond):
    return jnp.where(cond, 1.0, 0.0)


def _pairs(col, row):
    """[c, c]: col_i == row_j of a column [c, 1] and a row [1, c] of runs, both broadcast in full (int32)."""
    shape = (col.shape[0], row.shape[1])
    return jnp.broadcast_to(col, shape) == jnp.broadcast_to(row, shape)


def _over_lanes(col, width):
    """A 0/1 column [c, 1] -> [1, width]: whether any row holds 1 (a chunk's flag as a per-feature row)."""
    return jnp.max(jnp.broadcast_to(col, (col.shape[0], width)), axis=0, keepdims=True)


def _held(tau, real):
    """[c, 1], 0/1 in every row: whether the carried document has a valid key (its τ [1, block] above LOW/2)."""
    return jnp.max(_flag(jnp.broadcast_to(tau, real.shape) > 0.5 * LOW), axis=1, keepdims=True)


def _pick(onehot, x):
    """onehot [c, c] (rows of one 1 or none) @ x [c, block], exact at every precision (fused._pick): x as three
    bf16 parts, each picked exactly by a one-pass bf16 product. A reference rounded by the product could exceed
    every key its row sees, which the backward pass's β_i ≤ log den_i needs."""
    picked = jnp.zeros(x.shape, F32)
    for _ in range(3):
        part = x.astype(jnp.bfloat16)
        picked = picked + jax.lax.dot_general(onehot.astype(jnp.bfloat16), part, (((1,), (0,)), ((), ())),
                                              preferred_element_type=F32)
        x = x - part.astype(F32)
    return picked


def _doc_chunk(mm, queries, keys, values, runs, tau, real):
    """The chunk's factors given the carried document's τ [1, block] (LOW: no key yet). A row of the carried
    document (its run the one carried in) takes τ as its reference once that document has a key, any other row
    its document's first valid key in the chunk (every query that sees a key of its document here sees that
    one), picked exactly: fused's stabilisers to the bit."""
    keyed = _key_features(mm, keys, values, real)
    lk, c = keyed[0], real.shape[0]
    held = _held(tau, real)
    lanes = _iota((c, c), 1).astype(F32)
    valid = values.valid[...]
    keyed_lanes = jnp.broadcast_to(_as_row(valid), (c, c)) > 0           # [i, j]: slot j holds a key
    lk0 = jnp.where(_spread(valid, lk.shape), lk, 0.0)

    def reference(run):
        """[c, block]: the references of rows of runs `run` [c, 1], and which of them take the carried τ [c, 1]."""
        first = jnp.min(jnp.where(_pairs(run, runs.k_row[...]) & keyed_lanes, lanes, float(c)), axis=1,
                        keepdims=True)
        own = _pick(_flag(lanes == first), lk0)                  # zeros: no key of the document here
        carried = held * _flag(run == runs.enter[...])
        return jnp.where(_spread(carried, lk.shape), tau, own), carried

    kref, _ = reference(runs.k[...])
    qref, reads = reference(runs.q[...])
    tri = (_iota((c, c), 0) >= _iota((c, c), 1)) & _pairs(runs.q[...], runs.k_row[...])
    ch = _factors(_log_features(mm, queries, real), keyed, values.v[...], kref, qref, tri, real)
    return DocChunk(ch, valid, kref, held, reads)


def _doc_advance(mm, doc, runs, s, z):
    """(τ, S, z) after the chunk (fused._doc_carry): the state of its last slot's document on that document's
    running maximum, the carried state continued if it is the carried document, else restarted from the chunk's
    keys of that document; τ LOW while that document has no valid key."""
    ch, (c, width) = doc.ch, doc.kref.shape
    last = runs.last[...]
    cont = _over_lanes(doc.held * _flag(runs.enter[...] == last), width)       # [1, block]
    mine = doc.valid * _flag(runs.k[...] == last)                               # [c, 1]: its keys here
    ref = jnp.sum(jnp.where(_iota(doc.kref.shape, 0) == c - 1, doc.kref, 0.0), axis=0, keepdims=True)
    tau = jnp.maximum(ref, jnp.max(jnp.where(_spread(mine, ch.lk.shape), ch.lk, LOW), axis=0, keepdims=True))
    keep = jnp.exp(ref - tau)
    mk = jnp.where(_spread(mine, ch.fk.shape), ch.fk, 0.0)
    s = (jnp.where(_spread(cont, s.shape), s, 0.0) + mm.tn(ch.v * ch.w, mk)) * keep
    z = (jnp.where(_spread(cont, z.shape), z, 0.0) + jnp.sum(mk * ch.w, axis=0, keepdims=True)) * keep
    seen = jnp.maximum(cont, _over_lanes(mine, width))
    return jnp.where(_spread(seen, tau.shape), tau, LOW), s, z


def _doc_rows(fwd, beta):
    """(r, g, δ) of a chunk's rows: r_i = exp(β_i − log den_i), the output's cotangent g and δ_i = g_i·o_i
    minus the log-denominator's cotangent (∂ log den_i reaches the inputs as −δ_i's share does)."""
    g = fwd.g[...]
    return _ratio_to_den(beta, fwd.lden[...]), g, jnp.sum(g * fwd.o[...], axis=1, keepdims=True) - fwd.gl[...]


def _doc_fwd_kernel(queries, keys, values, runs, entering, out, carry, *, plan):
    """`_causal_fwd_kernel` with documents, from the entering carry; writes the τ each chunk entered with (with
    the runs, the backward passes rebuild every reference from it) and each a_j."""
    mm, real = _products(plan.products), _real(plan)

    def start():
        carry.tau[...], carry.s[...], carry.z[...] = entering.tau[...], entering.s[...], entering.z[...]
    _at_first_chunk(start)
    tau = carry.tau[...]
    doc = _doc_chunk(mm, queries, keys, values, runs, tau, real)
    out.o[...], out.lden[...] = _attend_chunk(mm, doc.ch, doc.reads, carry.s[...], carry.z[...])
    out.tau[...] = tau
    out.a[...] = doc.ch.a
    carry.tau[...], carry.s[...], carry.z[...] = _doc_advance(mm, doc, runs, carry.s[...], carry.z[...])


def _doc_dq_kernel(queries, keys, values, runs, entering, fwd, refs, out, state, *, plan):
    """∂l_q in sequence order, the carried state rebuilt as the forward pass built it."""
    mm, real = _products(plan.products), _real(plan)

    def start():
        state.s[...], state.z[...] = entering.s[...], entering.z[...]
    _at_first_chunk(start)
    doc = _doc_chunk(mm, queries, keys, values, runs, refs.tau[...], real)
    ch = doc.ch
    r, g, delta = _doc_rows(fwd, ch.beta)
    m = jnp.where(ch.tri, mm.nt(g, ch.v * ch.w) - delta * ch.w_row, 0.0)
    held = jnp.where(_spread(doc.reads, ch.fq.shape), mm.nn(g, state.s[...]) - delta * state.z[...], 0.0)
    dlq = ch.fq * r * (held + mm.nn(m, ch.fk))
    out.dx[...] = mm.nt(dlq, queries.p[...])
    out.dr[...] = jnp.sum(dlq, axis=1, keepdims=True)
    _, state.s[...], state.z[...] = _doc_advance(mm, doc, runs, state.s[...], state.z[...])


def _doc_dk_kernel(queries, keys, values, runs, entering, fwd, refs, out, carried, sums, *, plan):
    """∂l_k and ∂v in reverse (fused._doc_dk_kernel). Entering chunk i, U = Σ exp(l_q(i') + ρ − log den_i')
    [g_i', −δ_i'] over the later chunks' queries of the document of chunk i's last slot, on ρ = the τ entering
    chunk i + 1 (that document's maximum through chunk i, which bounds its keys here); only that document's keys
    read it. What is left after chunk 0 is U of the entering carry's document on its τ: the carry's (S, z)
    cotangent (`carried`)."""
    mm, real = _products(plan.products), _real(plan)
    _at_first_chunk(lambda: _start_sums(sums))
    tau, rho = refs.tau[...], refs.rho[...]
    doc = _doc_chunk(mm, queries, keys, values, runs, tau, real)
    ch = doc.ch
    r, g, delta = _doc_rows(fwd, ch.beta)
    later = doc.valid * _flag(runs.k[...] == runs.last[...])      # the keys of the document U belongs to
    ek = jnp.where(_spread(later, ch.lk.shape) & real, jnp.exp(jnp.minimum(ch.lk - rho, 0.0)), 0.0)
    pairs = (_iota(ch.tri.shape, 1) >= _iota(ch.tri.shape, 0)) & _pairs(runs.k[...], runs.q_row[...])
    ug, ud = sums.ug[...], sums.ud[...]
    fr = _key_grads(mm, ch, pairs, r, g, delta, ek, ug, ud, keys.p[...], out)
    # for chunk i − 1's keys: the queries here of the document carried in, and U if that document spans the chunk
    spans = _over_lanes(_flag(runs.enter[...] == runs.last[...]), tau.shape[1])
    keep = jnp.where(spans > 0, jnp.exp(jnp.minimum(tau - rho, 0.0)), 0.0)
    fc = jnp.where(_spread(doc.reads, fr.shape), fr, 0.0)
    sums.ug[...] = ug * keep + mm.tn(g, fc)
    sums.ud[...] = ud * keep - jnp.sum(fc * delta, axis=0, keepdims=True)

    def finish():
        carried.ug[...], carried.ud[...] = sums.ug[...], sums.ud[...]
    _at_last_chunk(finish)


# -- calls -------------------------------------------------------------------------------------------------
def _spec(kind, shape, plan, at):
    """The BlockSpec of one operand over the grid (b, h, g, i); `at(i)`: the chunk of grid step i."""
    c, fb = plan.chunk, plan.block
    if kind == "rows":          # [B, H, L, X]
        return pl.BlockSpec((None, None, c, shape[3]), lambda b, h, g, i: (b, h, at(i), 0))
    if kind in ("mask", "run"):     # [B, L, 1]
        return pl.BlockSpec((None, c, 1), lambda b, h, g, i: (b, at(i), 0))
    if kind == "run_row":       # [B, N, 1, c]: a chunk's runs as a row (its last two dims the array's own)
        return pl.BlockSpec((None, None, 1, c), lambda b, h, g, i: (b, at(i), 0, 0))
    if kind == "feat":          # [B', H', X, F']: B', H' = 1 broadcast over the batch, the heads
        pick = lambda n, k: k if n > 1 else 0
        return pl.BlockSpec((None, None, shape[2], fb), lambda b, h, g, i: (pick(shape[0], b), pick(shape[1], h), 0, g))
    if kind == "block_rows":    # [B, H, G, L, X]
        return pl.BlockSpec((None, None, None, c, shape[4]), lambda b, h, g, i: (b, h, g, at(i), 0))
    if kind == "chunk_feat":    # [B, H, N, 1, F']
        return pl.BlockSpec((None, None, None, 1, fb), lambda b, h, g, i: (b, h, at(i), 0, g))
    raise ValueError(kind)


def _specs(group, plan, at):
    """The group's BlockSpecs by its `kinds`; its fields arrays or (outputs) shapes."""
    return type(group)(*(_spec(k, getattr(a, "shape", a), plan, at) for k, a in zip(group.kinds, group)))


def _call(kernel, inputs, outs, grid, plan, *, scratch=(), sequential=True, reverse=False):
    """pallas_call of kernel(*inputs, *outs, *scratch, plan=plan) over grid (B, H, G, N): inputs a tuple of
    operand groups (arrays), outs a tuple of groups of output shapes (float32), scratch a tuple of groups of
    VMEM shapes; the chunk axis N sequential ("arbitrary") or not, walked in reverse with `reverse`."""
    n = grid[3]
    at = (lambda i: n - 1 - i) if reverse else (lambda i: i)
    out_shape = tuple(type(o)(*(jax.ShapeDtypeStruct(s, F32) for s in o)) for o in outs)
    scratch_shapes = tuple(type(s)(*(pltpu.VMEM(shape, F32) for shape in s)) for s in scratch)
    semantics = ("parallel",) * 3 + ("arbitrary" if sequential else "parallel",)
    return pl.pallas_call(
        functools.partial(kernel, plan=plan), grid=grid, out_shape=out_shape,
        in_specs=tuple(_specs(group, plan, at) for group in inputs),
        out_specs=tuple(_specs(o, plan, at) for o in outs),
        scratch_shapes=scratch_shapes,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=pltpu.InterpretParams() if plan.interpret else False,
    )(*inputs)


def _state_shapes(b, h, fp, dvp):
    return State((b, h, 1, fp), (b, h, dvp, fp), (b, h, 1, fp))


def _state_scratch(fb, dvp):
    return State((1, fb), (dvp, fb), (1, fb))


def _forward(queries, keys, values, causal, plan):
    """(out [B, H, Lq', Dv'], log-denominator [B, H, Lq', 1], what the backward pass reads, a_j [B, H, Lk']: each
    key's excess over its chunk's reference (causal; LOW for padding and bidirectional calls))."""
    b, h, lq, _ = queries.x.shape
    lk, dvp, fp = keys.x.shape[2], values.v.shape[3], queries.p.shape[3]
    c, fb = plan.chunk, plan.block
    g = fp // fb
    rows = lambda n, x: (b, h, g, n, x)
    if causal:
        n = lk // c
        outs = CausalRows(rows(lq, dvp), rows(lq, 1), (b, h, n, 1, fp), rows(lk, 1))
        o, lden, taus, excess = _call(_causal_fwd_kernel, (queries, keys, values), (outs,), (b, h, g, n), plan,
                                      scratch=(Carry((c, 1), *_state_scratch(fb, dvp)),))[0]
        out, lden = combine_blocks(o, lden[..., 0])
        return out, lden[..., None], taus, jnp.max(excess[..., 0], axis=2)
    state = _call(_key_state_kernel, (keys, values), (_state_shapes(b, h, fp, dvp),), (b, h, g, lk // c), plan,
                  scratch=(_state_scratch(fb, dvp),))[0]
    o, lden = _call(_bidir_fwd_kernel, (queries, state), (Rows(rows(lq, dvp), rows(lq, 1)),), (b, h, g, lq // c),
                    plan, sequential=False)[0]
    out, lden = combine_blocks(o, lden[..., 0])
    return out, lden[..., None], state, jnp.full((b, h, lk), LOW, F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _core(queries, keys, values, causal, plan):
    """(out, a_j) of the padded operands (the maps' P and c constants of the call: no gradient)."""
    out, _, _, excess = _forward(queries, keys, values, causal, plan)
    return out, excess


def _core_fwd(queries, keys, values, causal, plan):
    out, lden, saved, excess = _forward(queries, keys, values, causal, plan)
    return (out, excess), ((queries, keys, values), out, lden, saved)


def _core_bwd(causal, plan, residuals, cotangents):
    (queries, keys, values), out, lden, saved = residuals
    fwd = Cotangent(out, cotangents[0].astype(F32), lden)
    b, h, lq, dp = queries.x.shape
    lk, dkp, dvp, fp = keys.x.shape[2], keys.x.shape[3], values.v.shape[3], queries.p.shape[3]
    c, fb = plan.chunk, plan.block
    g = fp // fb
    rows = lambda n, x: (b, h, g, n, x)
    q_outs = InputGrads(rows(lq, dp), rows(lq, 1))
    k_outs = KeyGrads(rows(lk, dkp), rows(lk, 1), rows(lk, dvp))
    if causal:
        taus = saved
        refs = References(taus, jnp.concatenate([taus[:, :, 1:], taus[:, :, -1:]], axis=2))
        grid = (b, h, g, lk // c)
        inputs = (queries, keys, values, fwd, refs)
        dq = _call(_causal_dq_kernel, inputs, (q_outs,), grid, plan, scratch=(_state_scratch(fb, dvp),))[0]
        dk = _call(_causal_dk_kernel, inputs, (k_outs,), grid, plan, scratch=(Sums((dvp, fb), (1, fb)),),
                   reverse=True)[0]
    else:
        state = saved
        dq, sums = _call(_bidir_dq_kernel, (queries, fwd, state), (q_outs, Sums((b, h, dvp, fp), (b, h, 1, fp))),
                         (b, h, g, lq // c), plan, scratch=(Sums((dvp, fb), (1, fb)),))
        dk = _call(_bidir_dk_kernel, (keys, values, Tau(state.tau), sums), (k_outs,), (b, h, g, lk // c), plan,
                   sequential=False)[0]
    total = lambda a: jnp.sum(a, axis=2)            # the feature blocks' shares
    dq, dk = InputGrads(*map(total, dq)), KeyGrads(*map(total, dk))
    zero = jnp.zeros_like
    return (Map(dq.dx, dq.dr, zero(queries.p), zero(queries.c)), Map(dk.dx, dk.dr, zero(keys.p), zero(keys.c)),
            Values(dk.dv, zero(values.valid)))


_core.defvjp(_core_fwd, _core_bwd)


def _round_up(n, m):
    return -(-int(n) // m) * m


def _padded_map(x, r, p, c, lp, dp, fp):
    """One side's map padded for the kernels: rows to lp and D to dp (zeros), r as a [B, H, lp, 1] column,
    P [B', H', dp, fp] and c [B', H', 1, fp] with (batch, head) dims, features to fp (zeros: masked by index)."""
    return Map(pad_to(pad_to(x.astype(F32), 3, dp), 2, lp), pad_to(r.astype(F32), 2, lp)[..., None],
               pad_to(pad_to(feature_params(p.astype(F32), 2), 2, dp), 3, fp),
               pad_to(feature_params(c.astype(F32), 1), 2, fp)[:, :, None, :])


def _padded_values(v, valid, lp):
    """Values padded to lp rows and Dv to whole lanes; the key mask [B, lp, 1] as 0/1 floats (padding: 0)."""
    b, lk = v.shape[0], v.shape[2]
    valid = jnp.ones((b, lk), F32) if valid is None else jnp.asarray(valid, bool).astype(F32)
    return Values(pad_to(pad_to(v.astype(F32), 3, _round_up(v.shape[-1], LANES)), 2, lp),
                  pad_to(valid, 1, lp)[..., None])


def _fixed(side):
    """The map's parameters as constants of the kernel call (their cotangents are not computed)."""
    return side._replace(p=jax.lax.stop_gradient(side.p), c=jax.lax.stop_gradient(side.c))


def _plan(mode, length, features, interpret, precision, cut):
    """The Plan of a call over `length` rows (its longer side) and `features` features: TUNING[mode]'s cut or
    `cut`, the chunk of whole lanes where the sequence allows (the [chunk, chunk] tiles), else of whole
    sublanes."""
    precision = precision_name(precision)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    chunk, block = cut or TUNING[mode]
    if chunk % SUBLANES or block % LANES:
        raise ValueError(f"the TPU kernels cut calls into chunks of a multiple of {SUBLANES} rows and blocks of a "
                         f"multiple of {LANES} features; got {chunk} and {block}")
    c = min(chunk, _round_up(length, LANES if chunk % LANES == 0 else SUBLANES))
    # the widest block up to the tuned one that divides the features' whole lanes: F = 384 runs as three
    # blocks of 128, not as 512 features in two of 256 (a third more feature work)
    lanes = _round_up(features, LANES)
    fb = next(w for w in range(min(block, lanes), 0, -LANES) if lanes % w == 0)
    return Plan(c, fb, features, bool(interpret),
                "fp32" if interpret else MOSAIC_PRODUCTS[precision])


def attend(xq, rq, pq, cq, xk, rk, pk, ck, v, valid=None, causal=False, interpret=None, precision=None, cut=None):
    """fused.attend on a TPU (Mosaic): linear attention over log φ_q = xq·pq + cq + rq and log φ_k = xk·pk + ck +
    rk; xq [B, H, Lq, D], rq [B, H, Lq], xk, rk likewise over Lk, pq/pk [.., D, F] and cq/ck [.., F] with leading
    (batch, head) dims broadcast from the right, v [B, H, Lk, Dv], valid [B, Lk] or None. Returns (out [B, H, Lq,
    Dv] float32, exceeded [B, H, Lq] bool): the rows at or after a causal key that exceeded its chunk's reference
    by more than EXCEEDANCE (in the row's own batch and head), whose output the caller takes from an exact path.
    Causal needs Lq = Lk. Differentiable in xq, rq, xk, rk, v (not in the parameters). `interpret` None: on CPU
    (Pallas TPU interpret mode). `precision`: a fused.PRECISIONS name (None: fused.PRECISION), mapped by
    MOSAIC_PRODUCTS. `cut`: (chunk, feature block) instead of TUNING's (chunk a multiple of 8, block of 128).
    Packed documents: `document_pass`."""
    b, h, lq, d = xq.shape
    lk, dv, f = xk.shape[2], v.shape[-1], pq.shape[-1]
    if causal and lq != lk:
        raise ValueError(f"the TPU causal kernel needs Lq = Lk; got {lq} and {lk}")
    plan = _plan("causal" if causal else "bidirectional", max(lq, lk), f, interpret, precision, cut)
    c, fp = plan.chunk, _round_up(f, plan.block)
    lqp, lkp = (_round_up(lq, c), _round_up(lk, c)) if not causal else (_round_up(lq, c),) * 2
    queries = _padded_map(xq, rq, pq, cq, lqp, _round_up(d, LANES), fp)
    keys = _padded_map(xk, rk, pk, ck, lkp, _round_up(xk.shape[-1], LANES), fp)
    out, excess = _core(_fixed(queries), _fixed(keys), _padded_values(v, valid, lkp), bool(causal), plan)
    if not causal:                          # the bidirectional passes have no chunk form to exceed
        return out[:, :, :lq, :dv], jnp.zeros((b, h, lq), bool)
    exceeded = linear.cumulative(excess, jnp.maximum, LOW) > EXCEEDANCE
    return out[:, :, :lq, :dv], exceeded[:, :, :lq]


# -- calls with documents; prefill -------------------------------------------------------------------------
def _doc_forward(queries, keys, values, runs, entering, plan):
    """(out [B, H, L', Dv'], log-denominator [B, H, L'], the τ each chunk entered with [B, H, N, 1, F'], a_j
    [B, H, L'])."""
    b, h, l, _ = queries.x.shape
    dvp, fp = values.v.shape[3], queries.p.shape[3]
    g, n = fp // plan.block, l // plan.chunk
    rows = lambda x: (b, h, g, l, x)
    outs = CausalRows(rows(dvp), rows(1), (b, h, n, 1, fp), rows(1))
    o, lden, taus, excess = _call(_doc_fwd_kernel, (queries, keys, values, runs, entering), (outs,), (b, h, g, n),
                                  plan, scratch=(_state_scratch(plan.block, dvp),))[0]
    out, lden = combine_blocks(o, lden[..., 0])
    return out, lden, taus, jnp.max(excess[..., 0], axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _doc_core(queries, keys, values, runs, entering, plan):
    """(out, log-denominator, a_j) of the padded operands, entering with the carry `entering` (a State);
    differentiable in the maps' x and r, the values and the carry's (S, z)."""
    out, lden, _, excess = _doc_forward(queries, keys, values, runs, entering, plan)
    return out, lden, excess


def _doc_core_fwd(queries, keys, values, runs, entering, plan):
    out, lden, taus, excess = _doc_forward(queries, keys, values, runs, entering, plan)
    return (out, lden, excess), ((queries, keys, values, runs, entering), out, lden, taus)


def _doc_core_bwd(plan, residuals, cotangents):
    (queries, keys, values, runs, entering), out, lden, taus = residuals
    fwd = DocCotangent(out, cotangents[0].astype(F32), lden[..., None], cotangents[1].astype(F32)[..., None])
    # ρ of chunk i: the τ entering chunk i + 1 (the last chunk hands no sums on)
    refs = References(taus, jnp.concatenate([taus[:, :, 1:], jnp.zeros_like(taus[:, :, :1])], axis=2))
    b, h, l, dp = queries.x.shape
    dkp, dvp, fp = keys.x.shape[3], values.v.shape[3], queries.p.shape[3]
    fb = plan.block
    g = fp // fb
    rows = lambda x: (b, h, g, l, x)
    grid = (b, h, g, l // plan.chunk)
    inputs = (queries, keys, values, runs, entering, fwd, refs)
    dq = _call(_doc_dq_kernel, inputs, (InputGrads(rows(dp), rows(1)),), grid, plan,
               scratch=(_state_scratch(fb, dvp),))[0]
    dk, carried = _call(_doc_dk_kernel, inputs, (KeyGrads(rows(dkp), rows(1), rows(dvp)),
                                                 Sums((b, h, dvp, fp), (b, h, 1, fp))),
                        grid, plan, scratch=(Sums((dvp, fb), (1, fb)),), reverse=True)
    total = lambda a: jnp.sum(a, axis=2)            # the feature blocks' shares
    dq, dk = InputGrads(*map(total, dq)), KeyGrads(*map(total, dk))
    zero = jnp.zeros_like
    none = lambda a: np.zeros(a.shape, jax.dtypes.float0)      # the runs (integers) take no cotangent
    # the carry's τ is a stabiliser (its sums are on it): no cotangent of its own
    return (Map(dq.dx, dq.dr, zero(queries.p), zero(queries.c)), Map(dk.dx, dk.dr, zero(keys.p), zero(keys.c)),
            Values(dk.dv, zero(values.valid)), DocRuns(*map(none, runs)),
            State(zero(entering.tau), carried.ug, carried.ud))


_doc_core.defvjp(_doc_core_fwd, _doc_core_bwd)


def _entering(carry, b, h, dv, dvp, fp):
    """(the carry as the kernels read it, State(τ [B, H, 1, F'] (LOW where not seen, and in the padded features),
    S = Tᵀ [B, H, Dv', F'], z [B, H, 1, F']), its run [B]); no carry: LOW, zeros and linear.NO_RUN."""
    if carry is None:
        return (State(jnp.full((b, h, 1, fp), LOW, F32), jnp.zeros((b, h, dvp, fp), F32),
                      jnp.zeros((b, h, 1, fp), F32)), jnp.full((b,), linear.NO_RUN, jnp.int32))
    seen, tau, total, run = on_its_keys(carry)
    tau = jnp.where(seen[..., None], jax.lax.stop_gradient(tau).astype(F32), LOW)
    s = jnp.swapaxes(total[..., :dv].astype(F32), 2, 3)
    return (State(pad_to(tau, 2, fp, LOW)[:, :, None], pad_to(pad_to(s, 2, dvp), 3, fp),
                  pad_to(total[..., dv].astype(F32), 2, fp)[:, :, None]), jnp.asarray(run, jnp.int32))


def _doc_runs(qrun, krun, run, c):
    """DocRuns of the padded runs qrun, krun [B, L'] and the entering carry's run [B]."""
    b, lp = krun.shape
    last = krun[:, c - 1::c]                                     # [B, N]: each chunk's last key slot
    enter = jnp.concatenate([run[:, None], last[:, :-1]], axis=1)
    per_row = lambda a: jnp.repeat(a, c, axis=1)[..., None]
    as_rows = lambda a: a.reshape(b, lp // c, 1, c)
    return DocRuns(qrun[..., None], krun[..., None], as_rows(qrun), as_rows(krun), per_row(enter), per_row(last))


def document_pass(xq, rq, pq, cq, xk, rk, pk, ck, v, valid, qrun, krun, carry=None, interpret=None, precision=None,
                  cut=None):
    """fused.document_pass on a TPU (Mosaic): one causal pass in which query i sees the keys j ≤ i with krun_j =
    qrun_i (shapes as in `attend`, Lq = Lk; qrun, krun [B, L] int32 runs, non-decreasing), entering with `carry`,
    the state of keys before the sequence as favor.attention.documents.summary gives it — (seen [B, H], τ [B, H,
    F], T [B, H, F, Dv + 1] on τ, run [B]) — or None, read only by the queries of the carried document. Returns
    (out [B, H, L, Dv] float32, log-denominator [B, H, L] (LOW: no key), exceeded [B, H, L]: the rows at or after
    a key of their document beyond the bound). Differentiable in xq, rq, xk, rk, v and the carry's T (its τ is a
    stabiliser), the log-denominator's cotangent included. `interpret`, `precision`, `cut` as in `attend`."""
    b, h, l, d = xq.shape
    dv, f = v.shape[-1], pq.shape[-1]
    if xk.shape[2] != l or qrun.shape != (b, l) or krun.shape != (b, l):
        raise ValueError(f"the TPU document pass needs Lq = Lk and runs [B, L] = {(b, l)}; got Lq = {l}, Lk = "
                         f"{xk.shape[2]}, runs {tuple(qrun.shape)} and {tuple(krun.shape)}")
    plan = _plan("causal", l, f, interpret, precision, cut)
    lp, fp = _round_up(l, plan.chunk), _round_up(f, plan.block)
    queries = _padded_map(xq, rq, pq, cq, lp, _round_up(d, LANES), fp)
    keys = _padded_map(xk, rk, pk, ck, lp, _round_up(xk.shape[-1], LANES), fp)
    values = _padded_values(v, valid, lp)
    entering, run = _entering(carry, b, h, dv, values.v.shape[3], fp)
    qrun, krun = (pad_to(jnp.asarray(r, jnp.int32), 1, lp, linear.NO_RUN) for r in (qrun, krun))
    out, lden, excess = _doc_core(_fixed(queries), _fixed(keys), values, _doc_runs(qrun, krun, run, plan.chunk),
                                  entering, plan)
    # a key's excess reaches the later rows of its own document (the key runs lag the query runs by a shift)
    reach = linear.segmented(excess, krun[:, None], jnp.maximum, LOW)
    exceeded = jnp.where((qrun == krun)[:, None], reach, LOW) > EXCEEDANCE
    return out[:, :, :l, :dv], lden[:, :, :l], exceeded[:, :, :l]


def prefill(xk, rk, pk, ck, v, valid=None, interpret=None, precision=None, cut=None):
    """fused.prefill on a TPU: the decoding state after keys log φ_k = xk·pk + ck + rk and values v (shapes as in
    `attend`), by the key-state kernel: (τ [B, H, F], the per-feature key maximum, −inf where no valid key;
    Σ_j exp(l_k(j) − τ)[v_j, 1] [B, H, F, Dv + 1]), decoding.decode_prefill's "tau" and "sum". Not
    differentiable (a prompt's prefill). Cut as a bidirectional call (TUNING; `cut` as in `attend`)."""
    b, h, lk, d = xk.shape
    dv, f = v.shape[-1], pk.shape[-1]
    plan = _plan("bidirectional", lk, f, interpret, precision, cut)
    lkp, fp = _round_up(lk, plan.chunk), _round_up(f, plan.block)
    keys, values = jax.lax.stop_gradient((_padded_map(xk, rk, pk, ck, lkp, _round_up(d, LANES), fp),
                                          _padded_values(v, valid, lkp)))
    dvp = values.v.shape[3]
    state = _call(_key_state_kernel, (keys, values), (_state_shapes(b, h, fp, dvp),),
                  (b, h, fp // plan.block, lkp // plan.chunk), plan, scratch=(_state_scratch(plan.block, dvp),))[0]
    tau, z = state.tau[:, :, 0, :f], state.z[:, :, 0, :f]
    t = jnp.swapaxes(state.s, 2, 3)[:, :, :f, :dv]
    return jnp.where(tau > 0.5 * LOW, tau, -jnp.inf), jnp.concatenate([t, z[..., None]], -1)
