"""The bidirectional pass of linear attention, Y = diag(Φ_q (Φ_kᵀ 1))⁻¹ Φ_q (Φ_kᵀ V): keys summed in
chunks under a running per-feature stabiliser, queries read in chunks (or whole arrays while one [B, H,
L, F] array is small). Inputs and stabilisers as favor.attention.linear describes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from favor.attention.linear import (F32, LOWEST_SCALE, NEG_INF, _in_chunks, _mask_keys, _row_scaled, _valid_chunks,
                                    _with_sign, finite_or, jit_when_eager, ones_column, seq_length, sg)
from favor.attention.floor import ratio

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
