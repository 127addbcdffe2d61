"""Packed documents: linear attention where a token sees only the tokens of its own document.

A row packs documents back to back and `segment_ids` [B, L] names each token's document. A document is
a run of equal consecutive ids (`runs`): what every packer emits (ids that only grow along a row), and
the one reading under which a causal state can restart at a document's start — a repeated id after
another document is a new document. Pairs of tokens in different documents carry no weight, exactly:

    Y_i = Σ_{j ≤ i, r_j = r_i} φ_q(i)ᵀφ_k(j) v_j / Σ_{j ≤ i, r_j = r_i} φ_q(i)ᵀφ_k(j)       (causal)

and over every j with r_j = r_i when bidirectional. Not a subtraction of prefix sums (a document after a
long one would lose its digits to the earlier mass), and every stabiliser is a document's own: the
reference a key is measured against is its document's (the carried maximum while the document
continues from an earlier span, else the document's first key with mass), so a document of small
logits after one of large logits keeps every digit.

The causal pass runs spans as favor.attention.causal does, carrying (seen, τ, T, run): the carried
document's key maximum and sum, and which document that is (its run). Within a span, `_fast_span`
(chunks: a masked [C, C] product within a chunk, the state of the carried document across chunks),
and `_exact_span` (blocks whose pair terms are formed in log space) for the rows past a key of their
document that exceeds its reference by e^FAST_EXCEEDANCE. Query and key runs are separate arrays
(`rq`, `rk`): the window's off-band part and the bidirectional pass's reversed part shift the keys
against the queries.
Bidirectional = the causal sums (j ≤ i) plus the reversed causal sums over keys shifted by one
(j > i), each on its own scale, combined before the one division.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from favor.attention.causal import (CAUSAL_CHUNK, EXACT_BLOCK, FAST_EXCEEDANCE, PATHS, _span, _unit,
                                    aligned_queries, document_prefix, select_exact)
from favor.attention.floor import ratio
from favor.attention.linear import (F32, NEG_INF, NO_RUN, _in_chunks, _row_scaled, _valid_chunks, _with_sign, combine,
                                    finite_or, ones_column, segmented, seq_length, sg)



def check_segments(segment_ids, batch, length):
    """segment_ids as given -> int32 [B, L]; a wrong shape or a non-integer dtype is a ValueError naming it."""
    if segment_ids is None:
        return None
    shape = tuple(jnp.shape(segment_ids))
    if shape != (batch, length):
        raise ValueError(f"segment_ids marks each token's document, [B, L] = {(batch, length)}; got shape {shape}")
    dtype = jnp.asarray(segment_ids).dtype
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
        raise ValueError(f"segment_ids must be integers (a document id per token); got dtype {dtype}")
    return jnp.asarray(segment_ids, jnp.int32)


def runs(segment_ids):
    """[B, L] int32: 0 for the first document of a row, +1 at every change of id."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    change = (seg[:, 1:] != seg[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros_like(seg[:, :1]), jnp.cumsum(change, axis=1)], axis=1)


def same_document(rq, rk):
    """[B, Lq, Lk] booleans: query i and key j in one document (rq, rk runs of one sequence's positions)."""
    return rq[:, :, None] == rk[:, None, :]


RUN_TOP = 2 ** 30         # runs of a reversed sequence count down from here: ≥ 0, whatever its length or shard


def reversed_runs(r):
    """Runs of the reversed sequence, still non-decreasing, the same numbers on every shard of a sequence."""
    return RUN_TOP - jnp.flip(r, axis=1)


def shifted_runs(r, s):
    """Key runs moved s positions later (the first s positions hold no key: NO_RUN)."""
    l = r.shape[1]
    s = min(s, l)
    return jnp.pad(r, ((0, 0), (s, 0)), constant_values=NO_RUN)[:, :l]


def _expand(r):
    """[B, S] runs -> [B, 1, S] against [B, H, S] arrays."""
    return r[:, None]


def _references(lk, rk, carry_run, seen, tau):
    """Per key position j [B, H, S, F]: the reference of key j's document — the carried τ while the
    document continues from before the span and had a key, else the document's first key with mass in
    the span (0 where the document has none yet). Causal: key j's reference is fixed by keys ≤ j."""
    s = lk.shape[2]
    has = jnp.isfinite(jnp.max(lk, axis=-1))                                      # [B, H, S]
    first = segmented(jnp.where(has, jnp.arange(s), s), _expand(rk), jnp.minimum, s)
    anchor = jnp.take_along_axis(lk, jnp.minimum(first, s - 1)[..., None], axis=2)
    anchor = jnp.where((first < s)[..., None], finite_or(anchor), 0.0)
    carried = (_expand(rk == carry_run[:, None]) & seen[..., None])[..., None]   # [B, H, S, 1]
    return sg(jnp.where(carried, finite_or(tau)[:, :, None], anchor)), has


def _fast_span(lq, sq, lk, sk, v1, rq, rk, ref, has, carry, c):
    """The fast path over one span of S tokens in chunks of c (the document form of
    favor.attention.causal._fast_span): keys referenced to their document's reference ρ_j and normalised
    by a_j = max_f(l_k(j, f) − ρ_j); query i by β_i = max_f(l_q(i, f) + ρ_i); α_i the running maximum of
    a over i's document (0 included when the document continues from a span where it had keys), scale
    β_i + α_i. Across chunks each query reads the state of the document open at its chunk's start, when
    that is its own. Returns (out [B, H, S, Dv+1], log-scale [B, H, S], the carry after the span)."""
    seen, tau, total, carry_run = carry
    b, h, s, _ = lq.shape
    n = s // c
    a = sg(jnp.max(lk - ref, axis=-1))                                             # −inf: no mass
    carried = _expand(rq == carry_run[:, None]) & seen[..., None]                # [B, H, S]
    alpha = segmented(a, _expand(rk), jnp.maximum, NEG_INF)                       # over each key's document
    alpha = jnp.where(_expand(rk == carry_run[:, None]) & seen[..., None], jnp.maximum(alpha, 0.0), alpha)
    # query i's document has keys at positions ≤ i in the span exactly where the key run there is its own
    # (key runs lag query runs); elsewhere it sees the carried keys or none
    own = _expand(rq == rk)
    alpha = sg(jnp.where(own, alpha, jnp.where(carried, 0.0, NEG_INF)))
    ref_q = jnp.where(own[..., None], ref, finite_or(tau)[:, :, None])
    beta = sg(finite_or(jnp.max(lq + ref_q, axis=-1)))
    scale = jnp.where(jnp.isfinite(alpha), beta + alpha, NEG_INF)
    alpha = finite_or(alpha)
    row = _row_scaled(lk, sk)
    af = finite_or(a)
    if row:
        fk, fq = sk.astype(F32), sq.astype(F32)
        v1 = v1 * _unit(lk - ref - af[..., None])
        q_unit = _unit(lq + ref_q - beta[..., None])
    else:
        fk = _with_sign(jnp.exp(lk - ref - af[..., None]), sk)
        fq = _with_sign(jnp.exp(lq + ref_q - beta[..., None]), sq)
    w = jnp.where(jnp.isfinite(a), jnp.exp(jnp.minimum(a, FAST_EXCEEDANCE)), 0.0)
    chunked = lambda z: z.reshape(z.shape[0], z.shape[1], n, c, *z.shape[3:])
    fk_n, fq_n, v1w, alpha_n = map(chunked, (fk, fq, v1 * w[..., None], alpha))
    rq_n, rk_n = rq.reshape(b, n, c), rk.reshape(b, n, c)
    last = rk_n[:, :, -1]                                                         # [B, N]: each chunk's last run
    before = jnp.concatenate([carry_run[:, None], last[:, :-1]], axis=1)          # the run open at its start
    tail = (rk_n == last[..., None])[:, None, :, :, None]                         # [B, 1, N, c, 1]
    states = jnp.einsum("bhncd,bhncf->bhnfd", jnp.where(tail, v1w, 0.0), fk_n)  # the last document's keys
    prefix, state = document_prefix(states, last, before, total)                # [B, H, N, F, Dv+1]
    reads = (rq_n == before[..., None])[:, None, :, :, None]
    mask = jnp.tril(jnp.ones((c, c), bool)) & (rq_n[..., :, None] == rk_n[..., None, :])[:, None]
    scores = jnp.where(mask, jnp.einsum("bhnif,bhnjf->bhnij", fq_n, fk_n), 0.0)
    out = (jnp.exp(-alpha_n)[..., None] * (jnp.einsum("bhnif,bhnfd->bhnid", jnp.where(reads, fq_n, 0.0), prefix)
                                           + jnp.einsum("bhnij,bhnjd->bhnid", scores, v1w))).reshape(b, h, s, -1)
    if row:
        out = out * q_unit
    return out, scale, _carry_after(lk, rk, ref, has, carry, state)


def _carry_after(lk, rk, ref, has, carry, state):
    """The carry after a span: its last document (run), whether it has a key, its key maximum τ' and its
    sum `state` (on the document's reference) moved to τ'."""
    seen, _, _, carry_run = carry
    run = rk[:, -1]
    tail = _expand(rk == run[:, None])                                             # [B, 1, S]
    last_ref = ref[:, :, -1]
    new_tau = sg(jnp.maximum(last_ref, jnp.max(jnp.where(tail[..., None], lk, NEG_INF), axis=2)))
    keep = jnp.exp(jnp.minimum(last_ref - new_tau, 80.0))
    seen = ((run == carry_run)[:, None] & seen) | jnp.any(tail & has, axis=-1)
    return seen, new_tau, state * keep[..., None], run


def _exact_span(lq, sq, lk, sk, v1, rq, rk, carry, block):
    """The exact path over one span: blocks of `block` tokens scanned in order, each query's pair terms
    with its document's keys of the block formed in log space, the carried document's state read on its
    running key maximum, so every term is ≤ 1 and the largest 1, for any inputs."""
    b, h, s, _ = lq.shape
    e = min(block, s)
    nb = -(-s // e)
    pad = nb * e - s

    def blocks(a, fill):
        if a is None:
            return None
        a = jnp.pad(a, ((0, 0),) * 2 + ((0, pad),) + ((0, 0),) * (a.ndim - 3), constant_values=fill)
        return jnp.moveaxis(a.reshape(*a.shape[:2], nb, e, *a.shape[3:]), 2, 0)

    edge = lambda r: jnp.moveaxis(jnp.pad(r, ((0, 0), (0, pad)), mode="edge").reshape(b, nb, e), 1, 0)
    xs = (blocks(lq, 0.0), blocks(sq, 1.0), blocks(lk, NEG_INF), blocks(sk, 1.0), blocks(v1, 0.0), edge(rq),
          edge(rk))
    tril = jnp.tril(jnp.ones((e, e), bool))

    def step(carry, xb):
        seen, tau, total, run = carry
        lq_b, sq_b, lk_b, sk_b, v1_b, rq_b, rk_b = xb
        reads = (_expand(rq_b == run[:, None]) & seen[..., None])                  # [B, H, e]
        lqt = jnp.where(reads[..., None] & jnp.isfinite(tau)[:, :, None], lq_b + finite_or(tau)[:, :, None], NEG_INF)
        pairs = tril & (rq_b[:, :, None] == rk_b[:, None, :])[:, None]             # [B, 1, e, e]
        pair = jnp.where(pairs[..., None], lq_b[:, :, :, None, :] + lk_b[:, :, None, :, :], NEG_INF)
        top = jnp.maximum(jnp.max(lqt, axis=-1), jnp.max(pair, axis=(-2, -1)))
        ci = sg(finite_or(top))
        fq = _with_sign(jnp.exp(lqt - ci[..., None]), sq_b)
        terms = jnp.exp(pair - ci[..., None, None])
        if sq_b is not None:
            terms = terms * sq_b[:, :, :, None, :] * sk_b[:, :, None, :, :]
        out = (jnp.einsum("bhif,bhfd->bhid", fq, total)
               + jnp.einsum("bhij,bhjd->bhid", jnp.sum(terms, axis=-1), v1_b))
        scale = jnp.where(jnp.isfinite(top), ci, NEG_INF)
        # the carry moves to the block's last document
        last = rk_b[:, -1]
        tail = _expand(rk_b == last[:, None])                                     # [B, 1, e]
        lk_t = jnp.where(tail[..., None], lk_b, NEG_INF)
        continues = (last == run)[:, None] & seen
        base = jnp.where(continues[..., None], tau, NEG_INF)
        new_tau = sg(jnp.maximum(base, jnp.max(lk_t, axis=2)))
        keep = jnp.where(jnp.isfinite(base), jnp.exp(base - finite_or(new_tau)), 0.0)
        fk = _with_sign(jnp.exp(lk_t - finite_or(new_tau)[:, :, None]), sk_b)
        total = total * keep[..., None] + jnp.einsum("bhjd,bhjf->bhfd", v1_b, jnp.where(tail[..., None], fk, 0.0))
        has = jnp.any(tail & jnp.isfinite(jnp.max(lk_b, axis=-1)), axis=-1)
        return (continues | has, new_tau, total, last), (out, scale)

    # a row-scaled map (trig, HRF: one log-scale per row, bounded values) broadcasts its [.., 1] log-scales
    # against the values in the products above, and its τ stays one per row
    carry, (out, scale) = jax.lax.scan(jax.checkpoint(step), carry, xs)
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, nb * e, -1)[:, :, :s]
    scale = jnp.moveaxis(scale, 0, 2).reshape(b, h, nb * e)[:, :, :s]
    return out, scale, carry


def causal_sums(query_map, key_map, ctx, x, y, v1, valid, rq, rk, chunk_size=CAUSAL_CHUNK, path="auto", span=None,
                init=None):
    """Σ_{j ≤ i, rk_j = rq_i} φ_q(i)ᵀφ_k(j)[v_j, 1] on query i's scale: (out [B, H, L, Dv+1], log-scale
    [B, H, L]) as favor.attention.causal.causal_sums gives them, x and y of one length L, rq and rk [B, L]
    the queries' and the keys' runs (non-decreasing, rk ≤ rq). `init`: a carry (seen, τ, T, run) of keys
    before the sequence (`summary`, composed over earlier shards of a sharded sequence)."""
    if path not in PATHS:
        raise ValueError(f"unknown causal path {path!r}; valid: {', '.join(PATHS)}")
    l = seq_length(y)
    c = min(chunk_size, l)
    s = _span(c, l, span)
    n = -(-l // s)
    xs, ys, v1s, valids = _in_chunks(x, s), _in_chunks(y, s), _in_chunks(v1, s), _valid_chunks(valid, l, s)
    spans = lambda r: jnp.moveaxis(jnp.pad(r, ((0, 0), (0, n * s - l)), mode="edge").reshape(r.shape[0], n, s), 1, 0)
    rqs, rks = spans(rq), spans(rk)
    lk0, sk0 = jax.eval_shape(key_map, ctx, jax.tree.map(lambda a: a[0], ys))
    b, h, _, f = lk0.shape
    width = f if sk0 is None else sk0.shape[-1]
    if init is None:
        init = empty_carry(b, h, f, width, v1.shape[-1])

    def step(carry, inputs):
        x_s, y_s, v1_s, valid_s, rq_s, rk_s = inputs
        lq, sq = query_map(ctx, x_s)
        lk, sk = key_map(ctx, y_s)
        lq, v1_s = lq.astype(F32), v1_s.astype(F32)
        lk = jnp.where(valid_s[:, None, :, None], lk.astype(F32), NEG_INF)
        ops = (lq, sq, lk, sk, v1_s, rq_s, rk_s)
        exact = lambda o, cr: _exact_span(*o[:7], cr, EXACT_BLOCK)
        if path == "exact":
            out, scale, carry = exact(ops, carry)
        else:
            ref, has = _references(lk, rk_s, carry[3], carry[0], carry[1])
            fast = lambda o, cr: _fast_span(*o, cr, c)
            ops = ops + (ref, has)
            if path == "fast":
                out, scale, carry = fast(ops, carry)
            else:
                # per row, as favor.attention.causal: the exact path's output from the first key of the
                # row's own document beyond the bound (the key runs lag the query runs by the shift)
                a = jnp.max(lk - ref, axis=-1)
                over = segmented(a, _expand(rk_s), jnp.maximum, NEG_INF)
                over = jnp.where(_expand(rq_s == rk_s), over, NEG_INF) > FAST_EXCEEDANCE
                # the carry holds the span's last document: the exact path's, where a row of it needs that path
                last = _expand(rq_s == rk_s[:, -1:])
                out, scale, carry = select_exact(over, fast(ops, carry), lambda: exact(ops, carry), last)
        return carry, (out, scale)

    inputs = (xs, ys, v1s, valids, rqs, rks)
    if n == 1:
        _, (out, scale) = step(init, jax.tree.map(lambda a: a[0], inputs))
        out, scale = out[None], scale[None]
    else:
        _, (out, scale) = jax.lax.scan(jax.checkpoint(step), init, inputs)
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * s, -1)[:, :, :l]
    return out, jnp.moveaxis(scale, 0, 2).reshape(b, h, n * s)[:, :, :l]


def _flip(a):
    return jnp.flip(a, axis=2)


def _later(a, s, fill):
    """[B, H, L, X] moved s positions later along L (the first s rows `fill`)."""
    l = a.shape[2]
    s = min(s, l)
    return jnp.pad(a, ((0, 0), (0, 0), (s, 0)) + ((0, 0),) * (a.ndim - 3), constant_values=fill)[:, :, :l]


def empty_carry(b, h, f, width, dv1):
    """The carry before any key: (seen [B, H], τ [B, H, F], T [B, H, F', Dv+1], run [B])."""
    return (jnp.zeros((b, h), bool), jnp.zeros((b, h, f), F32), jnp.zeros((b, h, width, dv1), F32),
            jnp.full((b,), NO_RUN, jnp.int32))


def summary(lk, sk, v1, keep, run):
    """The carry a pass would leave after the keys `keep` [B, Lk] of lk/sk [B, H, Lk, ·] (all of one
    document, `run` [B]): seen, their per-feature maximum τ and Σ exp(l_k − τ)·sign·[v, 1] on it."""
    lk = jnp.where(keep[:, None, :, None], lk.astype(F32), NEG_INF)
    top = jnp.max(lk, axis=2)
    tau = sg(finite_or(top))
    fk = _with_sign(jnp.exp(lk - tau[:, :, None]), sk)
    total = jnp.einsum("bhld,bhlf->bhfd", v1.astype(F32), jnp.where(keep[:, None, :, None], fk, 0.0))
    return jnp.any(jnp.isfinite(top), axis=-1), tau, total, run


def merge(seen, tau, total, use):
    """Carries stacked along a leading axis (seen [n, B, H], τ [n, B, H, F], T [n, B, H, F', Dv+1]), those
    where `use` [n, B] holds all of one document: one carry (seen, τ, T), the maxima's maximum and each sum
    moved onto it once."""
    live = use[..., None] & seen                                                     # [n, B, H]
    top = sg(finite_or(jnp.max(jnp.where(live[..., None], tau, NEG_INF), axis=0)))
    keep = jnp.where(live[..., None], jnp.exp(jnp.minimum(tau - top, 80.0)), 0.0)
    return jnp.any(live, axis=0), top, jnp.sum(total * keep[..., None], axis=0)


def before_sums(query_map, key_map, ctx, x, y, v1, valid, r, chunk_size=CAUSAL_CHUNK, path="auto", span=None,
                gap=0, init=None):
    """Σ_{j ≤ i − gap, r_j = r_i} φ_q(i)ᵀφ_k(j)[v_j, 1]: (out, log-scale) as `causal_sums`, the key inputs
    (and their runs) moved `gap` positions later, the first `gap` rows no key."""
    l = seq_length(y)
    valid = jnp.ones((1, l), bool) if valid is None else jnp.asarray(valid, bool)
    valid = jnp.pad(valid, ((0, 0), (gap, 0)))[:, :l]
    return causal_sums(query_map, key_map, ctx, x, jax.tree.map(lambda a: _later(a, gap, 0.0), y),
                       _later(v1, gap, 0.0), valid, r, shifted_runs(r, gap), chunk_size, path, span, init)


def after_sums(query_map, key_map, ctx, x, y, v1, valid, r, chunk_size=CAUSAL_CHUNK, path="auto", span=None, gap=1,
               init=None):
    """Σ_{j ≥ i + gap, r_j = r_i} φ_q(i)ᵀφ_k(j)[v_j, 1]: `before_sums` over the reversed sequence (`init`
    a carry of the keys after it, its run a `reversed_runs` number)."""
    valid = None if valid is None else jnp.flip(jnp.asarray(valid, bool), axis=1)
    out, scale = before_sums(query_map, key_map, ctx, jax.tree.map(_flip, x), jax.tree.map(_flip, y), _flip(v1),
                             valid, reversed_runs(r), chunk_size, path, span, gap, init)
    return _flip(out), _flip(scale)


def bidirectional(query_map, key_map, ctx, x, y, v, valid, r, positive, chunk_size=CAUSAL_CHUNK, path="auto",
                  span=None, floor=None):
    """[B, H, L, Dv]: every query attends to every valid key of its document (x and y of one length)."""
    v1 = ones_column(v)
    parts = [causal_sums(query_map, key_map, ctx, x, y, v1, valid, r, r, chunk_size, path, span),
             after_sums(query_map, key_map, ctx, x, y, v1, valid, r, chunk_size, path, span)]
    out, scale = combine(parts)
    return ratio(out, positive, scale, floor)


def causal_maps(query_map, key_map, ctx, x, y, v, valid, runs, positive=True, chunk_size=CAUSAL_CHUNK, path="auto",
                span=None, floor=None):
    """favor.attention.causal.causal_maps over packed documents (`runs` [B, Lk]): each query sees the keys
    ≤ it of its own document; queries aligned to the last keys (Lq ≤ Lk)."""
    x, drop = aligned_queries(x, y, path)
    out, scale = causal_sums(query_map, key_map, ctx, x, y, ones_column(v), valid, runs, runs, chunk_size, path, span)
    return ratio(out[:, :, drop:], positive, scale[:, :, drop:], floor)
