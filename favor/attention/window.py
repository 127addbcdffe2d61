"""Local window + random features: exact softmax weights near the diagonal, the kind's estimate elsewhere.

For query i and key j (positions in one sequence; causal queries aligned to the last keys):

    w_ij = exp(x_iᵀy_j)          if j − i in the band: |i − j| ≤ w (causal: i − w ≤ j ≤ i, the last w + 1 keys)
    w_ij = φ_q(i)ᵀφ_k(j)         for every other key (j < i − w, and j > i + w when bidirectional)
    Y_i  = Σ_j w_ij v_j / Σ_j w_ij                                       (one shared normaliser)

with x = q·D^(−1/4), y = k·D^(−1/4), so exp(xᵀy) = exp(qᵀk/√D). Off the band the weights are the
kind's unbiased estimates, so the numerator and the denominator stay unbiased for softmax's; on the
band they are exact. w ≥ L − 1 is exact softmax. That is the "shared" mix. The "learned" one is
LoLCATs' (Zhang et al., 2024):

    w_ij = γ_h·exp(x_iᵀy_j − m_i)  on the band, m_i = max of x_iᵀy_j over the row's band keys
    w_ij = φ_q(i)ᵀφ_k(j)           elsewhere, unscaled;       one normaliser as above

γ_h = sigmoid(a_h) a learned per-head logit, started at γ = 0.1 (LoLCATs' start), so the band's weights
are at most γ_h and the linear part's scale is the feature map's own: what a learned map (Hedgehog, T2R)
needs, whose products approximate softmax's weights only up to a scale. m_i is part of that function,
not a stabiliser: its gradient flows.

How. The estimated part is the causal pass over keys shifted right by w + 1 positions (query i then
sees exactly keys j ≤ i − w − 1); bidirectional adds the same over the reversed sequence (keys
j ≥ i + w + 1). The band is exact attention over blocks of c ≥ w queries against the neighbouring key
blocks. Each part comes with its own log-scale (its sums are e^scale · out); they are brought to the
largest scale of the row before the one division, all scales under stop_gradient. Cost
O(L·(M + w)·D), memory linear in L. Decoding keeps the last w + 1 keys exactly and absorbs the key
that leaves the band into the linear state: the same result token by token.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from favor.attention import causal as causal_lib, decoding, documents, floor as floor_lib, linear
from favor.attention.floor import ratio
from favor.attention.linear import F32, NEG_INF, combine, finite_or, ones_column, seq_length

sg = jax.lax.stop_gradient
MIN_BLOCK = 16            # the band's query block is max(w, MIN_BLOCK) tokens (at most L)
MIXES = ("shared", "learned")
MIX_START = 0.1           # the learned mix's γ at the start (LoLCATs': the band gets a small weight)
MIX_LOGIT = math.log(MIX_START / (1.0 - MIX_START))


def check_window(name, window):
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"{name}: window must be an integer ≥ 0 (0: no window, w: exact softmax for "
                         f"|i − j| ≤ w); got {window!r}")
    return window


def _shift(a, s, fill):
    """[B, H, L, X] moved s positions later along L (the first s rows `fill`), still L long."""
    if a is None:
        return None
    l = a.shape[2]
    s = min(s, l)
    return jnp.pad(a, ((0, 0), (0, 0), (s, 0), (0, 0)), constant_values=fill)[:, :, :l]


def _flip(a):
    return None if a is None else jnp.flip(a, axis=2)


def _off_band_before(query_map, key_map, ctx, x, y, v1, valid, window, chunk_size, path, span, runs=None):
    """Σ_{j ≤ i − w − 1} φ_q(i)ᵀφ_k(j)[v_j, 1]: (out, log-scale) as causal_lib.causal_sums gives them.
    The key *inputs* move w + 1 positions later (the first w + 1 rows no key), so the causal pass makes
    the features span by span from them, as the plain causal pass does. `runs`: packed documents, each
    query's keys those of its own (the keys' runs move with them)."""
    s = window + 1
    if runs is not None:
        return documents.before_sums(query_map, key_map, ctx, x, y, v1, valid, runs, chunk_size, path, span, gap=s)
    l = seq_length(y)
    valid = jnp.ones((1, l), bool) if valid is None else jnp.asarray(valid, bool)
    valid = jnp.pad(valid, ((0, 0), (s, 0)))[:, :l]
    y = jax.tree.map(lambda a: _shift(a, s, 0.0), y)
    return causal_lib.causal_sums(query_map, key_map, ctx, x, y, _shift(v1, s, 0.0), valid, chunk_size, path, span)


def band_sums(x, y, v1, has_key, left, right, runs=None):
    """Exact Σ_{i − left ≤ j ≤ i + right, key j valid} exp(x_iᵀy_j)[v_j, 1]: (out [B, H, L, Dv+1],
    log-scale [B, H, L], −inf where the band holds no valid key). x, y [B, H, L, D], has_key [B, H, L].
    out is on the scale's stopped value; the scale returned keeps its gradient (the row's band maximum,
    which the learned mix reads).

    Blocks of c ≥ max(left, right) queries, so block n meets at most key blocks n − 1, n and n + 1: one
    [c, c] matmul per neighbour with its own fixed mask (a separate product per neighbour rather than one
    against the neighbours' keys concatenated: no copy of the keys, 20 % less time at w = 64). `runs`
    [B, L]: packed documents, pairs of two documents masked out."""
    b, h, l, d = x.shape
    # a band wider than the sequence is the whole sequence: clamped, so the cost follows L, not w (a model
    # configured with a large window still runs short sequences and 1-token prefills cheaply)
    left, right = min(left, l - 1), min(right, l - 1)
    c = min(l, max(left, right, MIN_BLOCK))
    n = -(-l // c)
    end = n * c - l
    blocked = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, end), (0, 0))).reshape(b, h, n, c, a.shape[-1])
    xb, yb, vb = blocked(x), blocked(y), blocked(v1)
    kb = blocked(has_key[..., None].astype(F32))[..., 0] > 0                 # [B, H, N, c]; pad rows False
    rb = None if runs is None else jnp.pad(runs, ((0, 0), (0, end)), mode="edge").reshape(b, 1, n, c)

    def moved(a, t):        # block n − t at position n (zeros, i.e. no key, beyond the sequence)
        if t == 0:
            return a
        pad = [(0, 0)] * a.ndim
        pad[2] = (t, 0) if t > 0 else (0, -t)
        return jnp.pad(a, pad)[:, :, :n] if t > 0 else jnp.pad(a, pad)[:, :, -t:]

    i = jnp.arange(c)
    logits, values = [], []
    # t = 1: the block before (used when left > 0), −1: the block after; none when there is one block
    for t in [t for t in (1, 0, -1) if (t == 0 or (n > 1 and (left if t > 0 else right) > 0))]:
        rel = i[None, :] - t * c - i[:, None]                                # [c, c]: j − i
        inside = (rel >= -left) & (rel <= right)
        keep = inside & moved(kb, t)[:, :, :, None, :]
        if rb is not None:
            keep = keep & (rb[..., :, None] == moved(rb, t)[..., None, :])
        scores = jnp.einsum("bhnid,bhnjd->bhnij", xb, moved(yb, t))
        logits.append(jnp.where(keep, scores, NEG_INF))
        values.append(moved(vb, t))
    m = functools.reduce(jnp.maximum, [jnp.max(z, axis=-1) for z in logits])   # −inf: no key in band
    mf = finite_or(sg(m))[..., None]
    out = sum(jnp.einsum("bhnij,bhnjd->bhnid", jnp.exp(z - mf), vz) for z, vz in zip(logits, values))
    return out.reshape(b, h, n * c, -1)[:, :, :l], m.reshape(b, h, n * c)[:, :, :l]


def _combined_ratio(parts, positive, drop, floor):
    out, scale = combine(parts)
    return ratio(out[:, :, drop:], positive, scale[:, :, drop:], floor)


def band_part(band, log_mix):
    """The band's (out, log-scale) as combine takes it: shared, its own scale (stopped: out is on it);
    learned (log_mix = log γ_h [H]), scale log γ_h − m_i in value, with m_i's gradient."""
    out, m = band
    if log_mix is None:
        return out, sg(m)
    lm = jnp.asarray(log_mix, F32).reshape((1, -1) + (1,) * (m.ndim - 2))
    return out, jnp.where(jnp.isfinite(m), lm + sg(finite_or(m)) - finite_or(m), NEG_INF)


@linear.jit_when_eager("query_map", "key_map", "positive", "window", "causal", "chunk_size", "path", "span")
def attend(query_map, key_map, ctx, x, y, v, valid, positive, window, causal, chunk_size=causal_lib.CAUSAL_CHUNK,
           path="auto", span=None, floor=None, band=None, log_mix=None, runs=None):
    """[B, H, Lq, Dv]. x/y the scaled queries and keys [B, H, L, D] (x_iᵀy_j = q_iᵀk_j/√D), from which
    query_map(ctx, x) / key_map(ctx, y) make the log-features row by row (as in
    favor.attention.causal.causal_maps; every key a valid mask admits has finite log-features),
    v [B, H, Lk, Dv], valid [B, Lk] or None. Causal: queries aligned to the last keys (Lq ≤ Lk);
    bidirectional: Lq = Lk (the band is a relation between positions of one sequence). `floor`: the
    bound a sign-indefinite kind's denominator is raised to (floor_lib.floored_ratio; the band's exact terms
    are part of the denominator it bounds). `band`: (x, y) the band reads where the maps' inputs are not
    the scaled queries and keys (default x, y). `log_mix`: log γ_h [H] for the learned mix (None: shared).
    `runs` [B, Lk]: packed documents (favor.attention.documents): the band and the estimate each stay
    inside a query's document."""
    l_q, l_k = x.shape[2], y.shape[2]
    if causal and l_q > l_k:
        raise ValueError(f"causal attention aligns queries to the last keys and needs Lq ≤ Lk; "
                         f"got Lq = {l_q}, Lk = {l_k}")
    if not causal and l_q != l_k:
        raise ValueError(f"window attention relates positions of one sequence: bidirectional needs Lq = Lk; "
                         f"got Lq = {l_q}, Lk = {l_k}")
    x, y = x.astype(F32), y.astype(F32)
    bx, by = (x, y) if band is None else (band[0].astype(F32), band[1].astype(F32))
    if l_q < l_k:   # queries i ↦ key position i + Lk − Lq; the front rows are computed and dropped
        x = jnp.pad(x, ((0, 0), (0, 0), (l_k - l_q, 0), (0, 0)))
        bx = jnp.pad(bx, ((0, 0), (0, 0), (l_k - l_q, 0), (0, 0)))
    v1 = ones_column(v)
    b, h = y.shape[:2]
    has_key = jnp.broadcast_to((jnp.ones((1, l_k), bool) if valid is None else jnp.asarray(valid, bool))[:, None],
                               (b, h, l_k))
    parts = [band_part(band_sums(bx, by, v1, has_key, window, 0 if causal else window, runs), log_mix)]
    if window >= l_k - 1:      # every key of every query is on the band: exact softmax, no feature pass
        return _combined_ratio(parts, positive, l_k - l_q, floor)
    parts.append(_off_band_before(query_map, key_map, ctx, x, y, v1, valid, window, chunk_size, path, span, runs))
    if not causal and runs is not None:
        parts.append(documents.after_sums(query_map, key_map, ctx, x, y, v1, valid, runs, chunk_size, path, span,
                                          gap=window + 1))
    elif not causal:
        flipped = None if valid is None else jnp.flip(jnp.asarray(valid, bool), axis=1)
        out, s = _off_band_before(query_map, key_map, ctx, _flip(x), _flip(y), _flip(v1), flipped, window,
                                  chunk_size, path, span)
        parts.append((_flip(out), _flip(s)))
    return _combined_ratio(parts, positive, l_k - l_q, floor)


# -- decoding -----------------------------------------------------------------------------------------
def decode_init(batch, heads, features, dim, dv, window, signed):
    """The linear state of the keys that left the band, and the last w + 1 keys (oldest first): their
    scaled keys y, log-features (and signs), values and whether each slot holds a key; signed kinds also
    the key sums of the denominator's floor."""
    w1 = window + 1
    state = {**decoding.decode_init(batch, heads, features, dv, dim if signed else None),
             "y": jnp.zeros((batch, heads, w1, dim), F32),
             "lk": jnp.full((batch, heads, w1, features), NEG_INF, F32),
             "v": jnp.zeros((batch, heads, w1, dv), F32),
             "key": jnp.zeros((batch, heads, w1), bool)}
    if signed:
        state["sk"] = jnp.ones((batch, heads, w1, features), F32)
    return state


def decode_prefill(lk, sk, y, v, window, valid=None, signed=False):
    """The state `decode_step` reaches after the keys lk [B, H, L, F | 1] (sign sk or None), y [B, H, L, D],
    v [B, H, L, Dv] one at a time, computed at once: the last w + 1 tokens' slots in the band (empty slots
    before a short prompt), the keys before them in the linear state, and every key in the floor's sums."""
    b, h, l = v.shape[:3]
    w1 = window + 1
    key = jnp.ones((b, l), bool) if valid is None else jnp.asarray(valid, bool)
    old = max(l - w1, 0)
    lin = decoding.decode_prefill(lk[:, :, :old], None if sk is None else sk[:, :, :old], v[:, :, :old],
                                key[:, :old])
    floor = decoding.decode_prefill(lk, sk, v, key, y.shape[-1], y) if signed else {}
    if signed:      # the rounding bound's mass: the keys that left the band only (jensen_floor's gap)
        norms = floor_lib.log_norm_bounds(lk[:, :, :old], None if sk is None else sk[:, :, :old])
        floor["knorm"] = jax.nn.logsumexp(jnp.where(key[:, None, :old], norms, NEG_INF), axis=2)
    features = lin["tau"].shape[-1]
    lk = lk.astype(F32)
    if sk is not None:                 # kept per feature in the buffer, as decode_step keeps it
        lk = jnp.broadcast_to(lk, sk.shape)
    lk = jnp.where(key[:, None, :, None], lk, NEG_INF)
    pad = max(w1 - l, 0)
    band = lambda a, fill: jnp.pad(a[:, :, old:], ((0, 0), (0, 0), (pad, 0)) + ((0, 0),) * (a.ndim - 3),
                                   constant_values=fill)
    state = {**lin, **{k: floor[k] for k in decoding.FLOOR_STATE if k in floor},
             "y": band(y.astype(F32), 0.0), "lk": band(lk, NEG_INF), "v": band(v.astype(F32), 0.0),
             "key": band(jnp.broadcast_to(key[:, None, :], (b, h, l)), False)}
    if signed:
        state["sk"] = band(jnp.ones((b, h, l, features), F32) if sk is None else sk.astype(F32), 1.0)
    return state


def decode_step(state, lq, sq, lk, sk, x, y, v, valid=None, positive=True, log_mix=None):
    """One token: lq, lk [B, H, F], x, y [B, H, D] (the band's scaled query and key), v [B, H, Dv] ->
    (out [B, H, Dv], state). The oldest of the w + 1 kept keys leaves the band (into the linear state);
    the new key joins it. log_mix: as `attend`'s."""
    lq, lk, x, y, v = (a.astype(F32) for a in (lq, lk, x, y, v))
    key = jnp.ones(lk.shape[:2], bool) if valid is None else jnp.broadcast_to(
        jnp.asarray(valid, bool)[:, None], lk.shape[:2])
    if sk is not None:              # a per-row log-scale (trig, HRF) is kept per feature in the buffer
        lk = jnp.broadcast_to(lk, sk.shape)
    lk = jnp.where(key[..., None], lk, NEG_INF)
    old_lk = jnp.where(state["key"][..., 0, None], state["lk"][:, :, 0], NEG_INF)
    lin = decoding.decode_absorb({"tau": state["tau"], "sum": state["sum"]}, old_lk,
                               state["sk"][:, :, 0] if "sk" in state else None, state["v"][:, :, 0])
    push = lambda buf, new: jnp.concatenate([buf[:, :, 1:], new[:, :, None]], axis=2)
    norms = (floor_lib.log_norm_bounds(lq, sq), floor_lib.log_norm_bounds(lk, sk))
    leaving = floor_lib.log_norm_bounds(old_lk, state["sk"][:, :, 0] if "sk" in state else None)
    sums, floor = decoding.decode_floor(state, x, y, v, valid, norms, leaving)
    new = {**lin, **sums, "y": push(state["y"], y), "lk": push(state["lk"], lk), "v": push(state["v"], v),
           "key": push(state["key"], key)}
    if "sk" in state:
        new["sk"] = push(state["sk"], jnp.ones_like(lk) if sk is None else sk.astype(F32))
    scores = jnp.where(new["key"], jnp.einsum("bhd,bhwd->bhw", x, new["y"]), NEG_INF)
    m = jnp.max(scores, axis=-1)
    p = jnp.exp(scores - finite_or(sg(m))[..., None])
    band = jnp.einsum("bhw,bhwd->bhd", p, ones_column(new["v"]))
    est = decoding.decode_read(lin, lq, sq)
    out, scale = combine([est, band_part((band, m), log_mix)])
    return ratio(out, positive, scale, floor), new
