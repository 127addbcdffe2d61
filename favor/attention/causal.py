"""The causal pass of linear attention, Y_i = φ_q(i)ᵀ Σ_{j≤i} φ_k(j) v_jᵀ / φ_q(i)ᵀ Σ_{j≤i} φ_k(j), in the
chunk form: within a chunk the masked [C, C] product of the chunk's features, across chunks the state
of the earlier ones, in spans scanned one after another; every stabiliser causal. Two algorithms, one
result (`causal_maps`): the fast chunked one, exact while no key exceeds its span's reference by
e^FAST_EXCEEDANCE, and an exact one for any input; and the plain pass of maps without exponentials
(`causal_plain`). Inputs as favor.attention.linear describes."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from favor.attention.linear import (F32, NEG_INF, NO_RUN, _chunks, _in_chunks, _mask_keys, _row_scaled, _valid_chunks,
                                    _with_sign, cumulative, finite_or, jit_when_eager, ones_column, seq_length, sg)
from favor.attention.floor import divide, ratio

# The fast causal path is exact while no key exceeds its chunk's reference by more than this (in
# log units); see `_fast_span`. Lost terms are then below e^(−87 + 40 + log(L·F)) of the
# denominator, under float32's resolution for L·F < e^30.
FAST_EXCEEDANCE = 40.0
EXACT_BLOCK = 16          # block of the exact causal path, whose diagonal blocks are formed in log space
PATHS = ("auto", "fast", "exact")
# tokens per chunk of the causal pass: its [C, C] in-chunk products cost C·(F + Dv + 1) per query against
# the bidirectional pass's 2·F·(Dv + 1), so smaller chunks do less work, until XLA:CPU's batched matmuls
# of that size run too slowly: with spans of 512 (below), C = 64 measured fastest at L = 8192 (favor+,
# round-robin: forward 1.63× bidirectional against 1.79× at C = 128 and 1.81× at C = 32 with spans of
# 256; forward and backward 1.84× against 2.02×)
CAUSAL_CHUNK = 64


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
    EXACT_BLOCK tokens in log space and is exact for any input, at several times the cost. "auto" runs
    the fast one and gives each row past a key beyond the bound (in its own batch and head) the exact
    one's output (`select_exact`: the exact path runs, under one `lax.cond` per span, only when some row
    needs it), so no later token and no other example moves an output, bit for bit. The fast path's
    guarantee assumes every valid key's log-features are finite (true of every random-feature map;
    ReLU's zeros are not: its kind runs "auto" as "exact"). Forced "fast" outside the guarantee can be
    wrong, gradients included: it is for benchmarks and tests. `floor` as in `bidirectional_maps`
    (here `jensen_floor(..., causal=True)`: prefix sums, causal too). Packed documents:
    favor.attention.documents.causal_maps.
    """
    x, drop = aligned_queries(x, y, path)
    out, scale = causal_sums(query_map, key_map, ctx, x, y, ones_column(v), valid, chunk_size, path, span)
    return ratio(out[:, :, drop:], positive, scale[:, :, drop:], floor)


def aligned_queries(x, y, path):
    """(x padded at the front to the keys' length, the rows to drop after): queries i ↦ key position
    i + Lk − Lq, the front rows computed and dropped; an unknown path or Lq > Lk is a ValueError."""
    if path not in PATHS:
        raise ValueError(f"unknown causal path {path!r}; valid: {', '.join(PATHS)}")
    l_q, l_k = seq_length(x), seq_length(y)
    if l_q > l_k:
        raise ValueError(f"causal attention aligns queries to the last keys and needs Lq ≤ Lk; "
                         f"got Lq = {l_q}, Lk = {l_k}")
    if l_q < l_k:
        x = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, 0), (l_k - l_q, 0), (0, 0))), x)
    return x, l_k - l_q


@jit_when_eager("positive", "chunk_size")
def causal_plain(fq, fk, v, valid=None, positive=True, chunk_size=CAUSAL_CHUNK, runs=None):
    """Causal attention for an elementwise feature map φ ≥ 0 with no exponential in it (ReLU, ELU + 1):
    the features fq = φ(x) [B, H, Lq, F], fk = φ(y) [B, H, Lk, F] are used as they are, not through log
    space — they cannot
    overflow (φ ≤ |u| + 1), so there is nothing for a stabiliser to do, and the log-space paths' −inf
    features (ReLU's exact zeros) would only push them onto the exact path at several times the cost.
    Chunks of `chunk_size`: each chunk's state Σ φ_k(j) v_jᵀ and key sum Σ φ_k(j), the exclusive prefix of
    earlier chunks by a running sum (`exclusive_prefix`), the chunk's own keys by a masked [C, C] product.
    Queries aligned to the last keys (Lq ≤ Lk). Exact to rounding while `plain_features_safe` holds
    (products that underflow would be lost: features of 1e-19 whose products carry a row's only mass); a
    query whose features are all 0 outputs 0. `runs` [B, Lk]: packed documents (as `causal_maps`): the
    state restarts at each document's start and the in-chunk product is masked to the document."""
    l_q, l_k = fq.shape[2], fk.shape[2]
    if l_q > l_k:
        raise ValueError(f"causal attention aligns queries to the last keys and needs Lq ≤ Lk; "
                         f"got Lq = {l_q}, Lk = {l_k}")
    fq = jnp.pad(fq.astype(F32), ((0, 0), (0, 0), (l_k - l_q, 0), (0, 0)))
    fk = _masked_features(fk.astype(F32), valid)
    c = min(chunk_size, l_k)
    fq_n, fk_n, v_n = _chunks(fq, c), _chunks(fk, c), _chunks(v.astype(F32), c)          # pad rows: zeros
    # The values and the denominator's ones apart, not as one [v, 1] operand: Dv + 1 columns (65 for
    # heads of 64) run XLA:CPU's matmuls at a fraction of their speed, and the concatenation is a copy
    # of the values. Keys as [F, C] per chunk: the state is then a plain [F, C]·[C, Dv] product, which
    # XLA:CPU hands to its fast matmul library, where a contraction over the first axis of both operands
    # ran 2.5 times slower (a profile of this pass at L = 8192). Together with the running sum below, the
    # pass alone went from 23.7 to 15.2 ms there (ReLU's features, C = 64, round-robin)
    fk_t = jnp.swapaxes(fk_n, -1, -2)                                                   # [B, H, N, F, C]
    tril = jnp.tril(jnp.ones((c, c), bool))
    fq_pre = fq_n
    if runs is None:
        states = jnp.einsum("bhnfc,bhncd->bhnfd", fk_t, v_n)                            # [B, H, N, F, Dv]
        prefix, key_prefix = exclusive_prefix(states), exclusive_prefix(jnp.sum(fk_n, axis=3))
    else:
        n = fk_n.shape[2]
        r_n = jnp.pad(runs, ((0, 0), (0, n * c - l_k)), mode="edge").reshape(runs.shape[0], n, c)
        last = r_n[:, :, -1]
        before = jnp.concatenate([jnp.full_like(last[:, :1], NO_RUN), last[:, :-1]], axis=1)
        tail = (r_n == last[..., None])[:, None, :, None, :]                            # the chunk's last document
        fk_tail = jnp.where(tail, fk_t, 0.0)
        prefix = document_prefix(jnp.einsum("bhnfc,bhncd->bhnfd", fk_tail, v_n), last, before)[0]
        key_prefix = document_prefix(jnp.sum(fk_tail, axis=4), last, before)[0]
        reads = (r_n == before[..., None])[:, None, :, :, None]                          # [B, 1, N, c, 1]
        fq_pre = jnp.where(reads, fq_n, 0.0)          # only queries of the document open at the chunk's start
        tril = tril & (r_n[..., :, None] == r_n[..., None, :])[:, None]
    scores = jnp.where(tril, jnp.einsum("bhnif,bhnjf->bhnij", fq_n, fk_n), 0.0)
    num = jnp.einsum("bhnif,bhnfd->bhnid", fq_pre, prefix) + jnp.einsum("bhnij,bhnjd->bhnid", scores, v_n)
    den = jnp.einsum("bhnif,bhnf->bhni", fq_pre, key_prefix) + jnp.sum(scores, axis=-1)
    b, h, n = num.shape[:3]
    rows = slice(l_k - l_q, l_k)
    return divide(num.reshape(b, h, n * c, -1)[:, :, rows], den.reshape(b, h, n * c)[:, :, rows], positive)


def exclusive_prefix(a, axis=2):
    """out[n] = Σ_{m < n} a[m] along `axis` (one chunk state per chunk of the sequence), a scan that adds one
    chunk at a time, so out[n] reads chunks before n only, bit for bit. Measured against
    `linear.cumulative_sum` (a matmul with a triangle of ones, which needs the chunk axis last: two
    transposes of every state) and doubling, in the whole plain pass at L = 8192: 9.0 ms with the scan,
    12.5 and 31.2 with those, on XLA:CPU with 128 chunks of [64, 64] states."""
    moved = jnp.moveaxis(a, axis, 0)
    _, out = jax.lax.scan(lambda total, x: (total + x, total), jnp.zeros_like(moved[0]), moved)
    return jnp.moveaxis(out, 0, axis)


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
        # a row past a key beyond the bound (in its batch and head) takes the exact path; every other row
        # keeps the fast path's output, which depends on its own row's keys ≤ it only
        over = cumulative(a, jnp.maximum, NEG_INF) > FAST_EXCEEDANCE                      # [B, H, S]
        out, scale, total = select_exact(over, _fast_span(*ops, c), lambda: _exact_span(*ops, c))
    return (seen | jnp.any(jnp.isfinite(a), -1), new_tau, total), (out, scale)


def select_exact(over, fast, exact, carried=None):
    """(out, scale, carry): the fast path's rows where `over` [B, H, S] is False, the exact path's
    (`exact()`, computed only when some row needs it: one lax.cond) where True, and the carry of the exact
    path for a batch and head with such a row among the rows of what the carry holds (`carried` [B, 1, S]:
    packed documents carry the span's last document only; None: every row). So a key beyond the bound
    moves no output of an earlier row, of another example, head or document, bit for bit. The carry is a
    pytree whose leaves lead with [B, H] (a [B] leaf, the run of packed documents, is the same on both
    paths)."""
    def taken():
        out, scale, carry = exact()
        pick = lambda e, f: jnp.where(jnp.reshape(over, over.shape + (1,) * (e.ndim - over.ndim)), e, f)
        head = jnp.any(over if carried is None else over & carried, axis=-1)
        moved = lambda e, f: e if e.ndim < 2 else jnp.where(jnp.reshape(head, head.shape + (1,) * (e.ndim - 2)), e, f)
        return pick(out, fast[0]), pick(scale, fast[1]), jax.tree.map(moved, carry, fast[2])
    return jax.lax.cond(jnp.any(over), taken, lambda: fast)


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


def document_prefix(states, last, before, init=None):
    """(per chunk n [B, H, N, ·] the sum of the chunk states before it that belong to the document open at
    its start, the sum after the last chunk): P_0 = init (0 if None), P_{n+1} = P_n·[chunk n continues that
    document] + states_n, `states` holding each chunk's last document's part only; last/before [B, N] the
    run each chunk ends with / starts in. A scan: one step per chunk, whatever their number."""
    moved = jnp.moveaxis(states, 2, 0)
    cont = jnp.moveaxis(last == before, 1, 0)                                   # [N, B]

    def step(total, xs):
        s_n, c_n = xs
        keep = c_n.reshape((-1,) + (1,) * (total.ndim - 1))
        return jnp.where(keep, total, 0.0) + s_n, total

    final, out = jax.lax.scan(step, jnp.zeros_like(moved[0]) if init is None else init, (moved, cont))
    return jnp.moveaxis(out, 0, 2), final
