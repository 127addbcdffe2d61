"""An independent float64 computation of what every attention kind estimates, for the tests.

Shares only the random draw ω and the fitted parameters with favor (read from the layer's context);
the feature formulas are written here again from MATH.md and the papers, in numpy float64, in log
space with a per-row shift, and the attention ratio is formed from the explicit L×L weights with an
exact division. Nothing here calls favor's feature maps, stabilisers, fits or guards.
"""

from __future__ import annotations

import math

import numpy as np


def _np(a):
    return np.asarray(a, np.float64)


def _inputs(a):
    """q, k or v in float64 as favor reads them: cast to float32 first (favor's own first step; bf16 is exact
    in it); an array that is float64 already (numpy) is taken as it is, so that finite differences of the
    reference can move it by less than a float32 unit."""
    a = np.asarray(a)
    return a if a.dtype == np.float64 else _np(np.asarray(a, np.float32))


def _sym_terms(la, sa, lb, sb):
    """Pairwise products of per-feature terms: (log|t| [..., Lx, Ly, T], sign or None)."""
    lt = la[..., :, None, :] + lb[..., None, :, :]
    st = None if sa is None and sb is None else (
        (np.ones_like(la) if sa is None else sa)[..., :, None, :] * (np.ones_like(lb) if sb is None else sb)[..., None, :, :])
    return lt, st


def exponential_log_features(u, t, a, omega, log_w):
    """MATH.md's dense-exponential map: Σ_l [¼log(1−4a_l) + a_l ω_l² + √(1−4a_l) ω_l u'_l] − ½||u'||²
    + ½ log w − ½ log M, u' = u·T. u [..., L, d] -> [..., L, M]."""
    ut = u @ t
    b = np.sqrt(1.0 - 4.0 * a)                                          # [..., d]
    m = omega.shape[-2]
    proj = np.einsum("...ld,...md->...lm", ut, omega * b[..., None, :])
    const = (0.25 * np.sum(np.log1p(-4.0 * a), -1)[..., None] + np.einsum("...md,...d->...m", omega ** 2, a)
             + 0.5 * log_w - 0.5 * math.log(m))
    return proj + const[..., None, :] - 0.5 * np.sum(ut * ut, -1)[..., None]


def _trig_terms(x, y, omega):
    """Ŝ_trig = (1/m) Σ cos(ω(x − y)) e^{(||x||²+||y||²)/2}: m terms per pair."""
    m = omega.shape[-2]
    diff = x[..., :, None, :] - y[..., None, :, :]
    c = np.einsum("...ijd,...md->...ijm", diff, np.broadcast_to(omega, (*x.shape[:-2], *omega.shape[-2:])))
    cos = np.cos(c)
    norms = 0.5 * (np.sum(x * x, -1)[..., :, None] + np.sum(y * y, -1)[..., None, :])
    return np.log(np.abs(cos)) + norms[..., None] - math.log(m), np.sign(cos)


def _antithetic_terms(x, y, omega):
    """Ŝ₊₊ = (1/2m) Σ [e^{ω(x+y)} + e^{−ω(x+y)}] e^{−(||x||²+||y||²)/2}: 2m terms per pair."""
    m = omega.shape[-2]
    s = x[..., :, None, :] + y[..., None, :, :]
    p = np.einsum("...ijd,...md->...ijm", s, np.broadcast_to(omega, (*x.shape[:-2], *omega.shape[-2:])))
    norms = -0.5 * (np.sum(x * x, -1)[..., :, None] + np.sum(y * y, -1)[..., None, :])
    return np.concatenate([p, -p], -1) + norms[..., None] - math.log(2 * m)


def _hybrid_terms(mech, x, y, draw, params):
    """HRF: Ŝ = λ̂·Ŝ₊₊ + (1 − λ̂)·Ŝ_trig with λ̂ from the variant's own definition (HRF §3)."""
    lp = _antithetic_terms(x, y, _np(draw.pos.omega))
    lt, st = _trig_terms(x, y, _np(draw.trig.omega))
    if mech.name == "hrf-angular":
        tau = _np(draw.lam.omega)
        sx, sy = np.sign(x @ tau.T), np.sign(y @ tau.T)
        sx[sx == 0], sy[sy == 0] = 1.0, 1.0
        lam = 0.5 - np.einsum("...in,...jn->...ij", sx, sy) / (2 * tau.shape[0])
    elif mech.name == "hrf-gaussian":
        tau = _np(draw.lam.omega)
        s = x[..., :, None, :] + y[..., None, :, :]
        lam = np.mean(np.cos(mech.sigma * np.einsum("...ijd,nd->...ijn", s, tau)), -1)
    else:   # hrf-cluster: λ fitted per (query cluster, key cluster), clusters by the nearest centre
        cq, ck, table = _np(params.q_centers), _np(params.k_centers), _np(params.lam)
        iq = np.argmin(np.sum((x[..., :, None, :] - cq[..., None, :, :]) ** 2, -1), -1)
        ik = np.argmin(np.sum((y[..., :, None, :] - ck[..., None, :, :]) ** 2, -1), -1)
        table = np.broadcast_to(table, (*x.shape[:-2], *table.shape[-2:]))
        lam = np.take_along_axis(np.take_along_axis(table, iq[..., :, None], -2),
                                 np.broadcast_to(ik[..., None, :], (*iq.shape, ik.shape[-1])), -1)
    with np.errstate(divide="ignore"):
        la, sa = np.log(np.abs(lam)), np.sign(lam)
        lb, sb = np.log(np.abs(1.0 - lam)), np.sign(1.0 - lam)
    logs = np.concatenate([lp + la[..., None], lt + lb[..., None]], -1)
    signs = np.concatenate([np.broadcast_to(sa[..., None], lp.shape), st * sb[..., None]], -1)
    if mech.name == "hrf-angular":
        # its indicator form weights each base term by λ̂ or 1 − λ̂ exactly (0 or k/n): no λ-cancellation.
        # A feature-space computation forms each frequency's cos(ω(x − y)) as sin·sin + cos·cos, terms up
        # to e^{(||x||²+||y||²)/2}/m each, so those are the magnitudes it sums
        m = draw.trig.omega.shape[-2]
        bound = 0.5 * (np.sum(x * x, -1)[..., :, None] + np.sum(y * y, -1)[..., None, :]) - math.log(m)
        mags = np.concatenate([lp + la[..., None], np.broadcast_to((bound + lb)[..., None], lt.shape)], -1)
        return logs, signs, mags
    # Lemma 2.3's tensor-product form (the other variants) sums λ̂'s parts separately: Ŝ₊₊ with total
    # weight a + Σ|ρ_q ρ_k| ≤ 1 and Ŝ_trig with (1 − a) + Σ|ρ_q ρ_k| ≤ 2, which cancel to λ̂ and 1 − λ̂
    # only in exact arithmetic. The float condition is that of those magnitudes.
    mags = np.concatenate([lp, lt + math.log(2.0)], -1)
    return logs, signs, mags


def _log_softmax(z):
    top = np.max(z, -1, keepdims=True)
    return z - top - np.log(np.sum(np.exp(z - top), -1, keepdims=True))


def _learned_terms(attn, x, y, weights):
    """A learned map's terms from its weights (the layer's, or the seed's initial ones: data, like ω),
    the map written here: Hedgehog [log softmax(xW), log softmax(−xW)] with W_q, W_k; T2R log ReLU(xW + b)."""
    if weights is None:
        import jax
        weights = attn.init_weights(jax.random.PRNGKey(attn.seed), x.shape[1], x.shape[-1])
    w = _np(np.asarray(weights, np.float32))
    if attn.name == "hedgehog":
        def feats(u, m):
            z = np.einsum("bhld,hdf->bhlf", u, m)
            return np.concatenate([_log_softmax(z), _log_softmax(-z)], -1)
        return _sym_terms(feats(x, w[0]), None, feats(y, w[1]), None)
    feats = lambda u: np.maximum(np.einsum("bhld,hdf->bhlf", u, w[:, :-1]) + w[None, :, None, -1], 0.0)
    with np.errstate(divide="ignore"):
        return _sym_terms(np.log(feats(x)), None, np.log(feats(y)), None)


def pair_terms(attn, q, k, ctx):
    """Every term of the estimate of exp(x_iᵀy_j) for every pair, (log|t|, sign or None[, log of the
    magnitude a feature-space computation must sum]) [B, H, Lq, Lk, T], with x = q·D^(−1/4),
    y = k·D^(−1/4) in float64."""
    d = q.shape[-1]
    x = np.swapaxes(_inputs(q), 1, 2) * d ** -0.25
    y = np.swapaxes(_inputs(k), 1, 2) * d ** -0.25
    name = attn.name
    if name == "softmax":           # exact softmax: the one term exp(x_iᵀy_j)
        return np.einsum("bhid,bhjd->bhij", x, y)[..., None], None
    if name in ("relu", "elu"):
        phi = (lambda u: np.maximum(u, 0.0)) if name == "relu" else (lambda u: np.where(u > 0, u + 1.0, np.exp(u)))
        xq = np.swapaxes(_inputs(q), 1, 2)
        yk = np.swapaxes(_inputs(k), 1, 2)
        with np.errstate(divide="ignore"):
            return _sym_terms(np.log(phi(xq)), None, np.log(phi(yk)), None)
    if name in ("hedgehog", "t2r"):
        return _learned_terms(attn, np.swapaxes(_inputs(q), 1, 2), np.swapaxes(_inputs(k), 1, 2), ctx)
    mech, draw, params = attn.mech, ctx.draw, ctx.params
    if mech.name == "trig":
        return _trig_terms(x, y, _np(draw.omega))
    if mech.name.startswith("hrf"):
        return _hybrid_terms(mech, x, y, draw, params)
    omega, log_w = _np(draw.omega), _np(draw.log_weights)
    lx = exponential_log_features(x, _np(params.tq), _np(params.a), omega, log_w)
    ly = exponential_log_features(y, _np(params.tk), _np(params.a), omega, log_w)
    return _sym_terms(lx, None, ly, None)


def documents(segment_ids):
    """segment_ids [B, L] -> each token's document [B, L]: its run's index, a run being consecutive equal ids
    (an id seen again after another run starts a new document)."""
    ids = np.asarray(segment_ids)
    starts = np.concatenate([np.ones((ids.shape[0], 1), bool), ids[:, 1:] != ids[:, :-1]], 1)
    return np.cumsum(starts, 1)


def same_document(segment_ids, lq):
    """[B, 1, Lq, Lk]: whether query i and key j are in one document, segment_ids [B, Lk] the keys' and the
    queries aligned to the last Lq keys (as a causal call aligns them)."""
    doc = documents(segment_ids)
    return (doc[:, -lq:, None] == doc[:, None, :])[:, None]


def _band(lq, lk, window, causal):
    rel = np.arange(lk)[None, :] - (np.arange(lq)[:, None] + lk - lq)          # j − i in positions
    return (rel >= -window) & (rel <= (0 if causal else window))


def _scores(q, k):
    d = q.shape[-1]
    x = np.swapaxes(_inputs(q), 1, 2) * d ** -0.25
    y = np.swapaxes(_inputs(k), 1, 2) * d ** -0.25
    return np.einsum("bhid,bhjd->bhij", x, y)


def mix_shift(q, k, window, causal, keep, log_mix):
    """The learned (LoLCATs) mix's shift of the band's log-weights, log γ_h − m_i [B, H, Lq, 1], m_i the
    largest q_iᵀk_j/√D over the band keys query i sees (`keep` [B, 1, Lq, Lk]); 0 where it sees none."""
    s = _scores(q, k)
    band = _band(s.shape[2], s.shape[3], window, causal)
    m = np.max(np.where(band & keep, s, -np.inf), -1, keepdims=True)
    lm = np.asarray(log_mix, np.float64)[None, :, None, None]
    return np.where(np.isfinite(m), lm - m, 0.0)


def with_window(terms, q, k, window, causal, shift=0.0):
    """The terms of the local-window hybrid: for pairs in the band (|i − j| ≤ w, causal i − w ≤ j ≤ i,
    queries at the last positions) the one exact term exp(q_iᵀk_j/√D + shift), every estimated term
    removed; elsewhere the estimate's terms."""
    lt, st = terms[:2]
    lm = terms[2] if len(terms) > 2 else lt
    d = q.shape[-1]
    x = np.swapaxes(_inputs(q), 1, 2) * d ** -0.25
    y = np.swapaxes(_inputs(k), 1, 2) * d ** -0.25
    lq, lk = x.shape[2], y.shape[2]
    rel = np.arange(lk)[None, :] - (np.arange(lq)[:, None] + lk - lq)          # j − i in positions
    band = (rel >= -window) & (rel <= (0 if causal else window))
    exact = (np.einsum("bhid,bhjd->bhij", x, y) + shift)[..., None]
    pick = lambda on_band, off_band: np.concatenate(
        [np.where(band[..., None], -np.inf, off_band), np.where(band[..., None], on_band, -np.inf)], -1)
    lt2, lm2 = pick(exact, lt), pick(exact, lm)
    st2 = None if st is None else np.concatenate([st, np.ones_like(exact)], -1)
    return lt2, st2, lm2


def attention(attn, q, k, v, ctx, mask=None, causal=False, window=0, log_mix=None, segment_ids=None):
    """(out [B, Lq, H, Dv], bound [B, Lq, H]): the float64 attention output of the estimator, and the
    size of a float rounding error relative to it, Σ|terms|·(|v| + |out|)/|den| (the ratio's condition;
    for positive kinds ≈ 2·max|v|). Rows with no valid key output 0. `window` > 0: the local-window
    hybrid (exact weights on the band); `log_mix` log γ_h [H]: its learned mix (band weights
    γ_h·exp(q_iᵀk_j/√D − m_i)). `segment_ids` [B, Lk]: packed documents (`documents`), the weight of every
    pair in two documents exactly 0 (band, estimate, stabiliser and floor each inside the document). `attn`
    may be softmax too: exact weights (with `window`, on the band alone)."""
    terms = pair_terms(attn, q, k, ctx)
    b, lq, h = q.shape[:3]
    lk = k.shape[1]
    keep = np.ones((b, 1, lq, lk), bool)
    if mask is not None:
        keep &= np.asarray(mask, bool)[:, None, None, :]
    if causal:
        keep &= np.tril(np.ones((lq, lk), bool), k=lk - lq)[None, None]
    if segment_ids is not None:
        keep &= same_document(segment_ids, lq)
    if window and attn.name == "softmax":       # sliding-window softmax: the band alone
        keep &= _band(lq, lk, window, causal)[None, None]
    elif window:
        shift = 0.0 if log_mix is None else mix_shift(q, k, window, causal, keep, log_mix)
        terms = with_window(terms, q, k, window, causal, shift)
    lt, st = terms[:2]
    lm = terms[2] if len(terms) > 2 else lt
    lt = np.where(keep[..., None], lt, -np.inf)
    lm = np.where(keep[..., None], lm, -np.inf)
    shift = np.max(lm, axis=(-2, -1), keepdims=True)
    shift = np.where(np.isfinite(shift), shift, 0.0)
    mag = np.exp(lt - shift)
    w = np.sum(mag if st is None else mag * st, -1)                    # [B, H, Lq, Lk]
    wabs = np.sum(np.exp(lm - shift), -1)
    vv = np.swapaxes(_inputs(v), 1, 2)                                 # [B, H, Lk, Dv]
    num, den = w @ vv, np.sum(w, -1)
    low = np.zeros(den.shape, bool)
    if not getattr(attn, "positive", True):
        # the true denominator Σ_j exp(x_iᵀy_j) ≥ n·exp(x_iᵀ mean_j y_j) (Jensen): a sign-indefinite
        # estimate below it is raised to it, the missing mass carrying the mean value, and the row kept
        # in the values' range (floored_ratio's definition, written here again)
        log_bound, mean, lo, hi = _jensen(q, k, vv, keep)
        bound = np.exp(log_bound - shift[..., 0, 0])
        low = np.isfinite(log_bound) & (den < bound)
        raised = np.where(low, np.maximum(bound, np.finfo(np.float64).tiny), den)
        num = np.where(low[..., None], num + (raised - den)[..., None] * mean, num)
        den = np.where(low, raised, den)
    out = np.where(den[..., None] != 0, num / np.where(den == 0, 1.0, den)[..., None], 0.0)
    if low.any():
        out = np.where(low[..., None], np.clip(out, lo, hi), out)
    cond = (wabs @ np.abs(vv) + np.sum(wabs, -1)[..., None] * np.abs(out)) / np.where(den == 0, 1.0, np.abs(den))[..., None]
    cond = np.where(den[..., None] == 0, 0.0, cond)
    return np.swapaxes(out, 1, 2), np.swapaxes(np.max(cond, -1), 1, 2)


def _jensen(q, k, vv, keep):
    """Over the keys `keep` [B, 1|H, Lq, Lk] lets query i see, in float64: (log(n_i·exp(x_iᵀȳ_i)), −inf
    where it sees none; the mean, minimum and maximum of their values [B, H, Lq, Dv])."""
    d = q.shape[-1]
    x = np.swapaxes(_inputs(q), 1, 2) * d ** -0.25
    y = np.swapaxes(_inputs(k), 1, 2) * d ** -0.25
    kf = keep.astype(np.float64)
    n = np.sum(kf, -1)                                                    # [B, 1|H, Lq]
    mean_y = (kf @ y) / np.maximum(n, 1)[..., None]
    mean_v = (kf @ vv) / np.maximum(n, 1)[..., None]
    seen = keep[..., None]
    lo = np.min(np.where(seen, vv[:, :, None], np.inf), axis=-2)
    hi = np.max(np.where(seen, vv[:, :, None], -np.inf), axis=-2)
    with np.errstate(divide="ignore"):
        return np.where(n > 0, np.log(n) + np.sum(x * mean_y, -1), -np.inf), mean_v, lo, hi


def explicit_attention(attn, q, k, v, mask=None, causal=False, rng=None, stats=None, window=0, mix=None,
                       draw=None):
    """The attention a feature kind computes, as the explicit L×L weights in jax float64, for gradients:
    W_ij = φ_q(i)ᵀφ_k(j) from the layer's own log-features and ω (exp(q_iᵀk_j/√D) on the window's
    band), then W V / W 1 with a plain division. It shares the feature map with the code under test,
    never its stabilisers, chunking, scans or guards: what its autodiff checks is the linear core's
    backward pass. `mix`: the learned window mix's logits [H] (band weights σ(mix_h)·exp(s_ij − m_i),
    m_i the row's largest band score, its gradient kept). Call under jax.enable_x64."""
    import jax
    import jax.numpy as jnp
    f64 = lambda a: None if a is None else jnp.asarray(a, jnp.float64)
    ctx = attn.context(q, k, mask, rng, None, None, None, stats, causal) if hasattr(attn, "mech") else draw
    (lq, sq), (lk, sk) = attn.log_maps(q, k, ctx)
    lq, sq, lk, sk = map(f64, (lq, sq, lk, sk))
    fq = jnp.exp(lq) * (1.0 if sq is None else sq)
    fk = jnp.exp(lk) * (1.0 if sk is None else sk)
    w = jnp.einsum("bhif,bhjf->bhij", fq, fk)
    l_q, l_k = q.shape[1], k.shape[1]
    rel = jnp.arange(l_k)[None, :] - (jnp.arange(l_q)[:, None] + l_k - l_q)    # j − i in positions
    keep = jnp.ones((1, 1, l_q, l_k), bool)
    if mask is not None:
        keep = keep & jnp.asarray(mask, bool)[:, None, None, :]
    if causal:
        keep = keep & (rel <= 0)
    if window:
        scale = q.shape[-1] ** -0.25
        x, y = (jnp.swapaxes(f64(a), 1, 2) * scale for a in (q, k))
        band = (rel >= -window) & (rel <= (0 if causal else window))
        s = jnp.einsum("bhid,bhjd->bhij", x, y)
        if mix is not None:
            m = jnp.max(jnp.where(band & keep, s, -jnp.inf), -1, keepdims=True)
            s = s - jnp.where(jnp.isfinite(m), m, 0.0) + jax.nn.log_sigmoid(f64(mix))[None, :, None, None]
        w = jnp.where(band, jnp.exp(s), w)
    w = jnp.where(keep, w, 0.0)
    num, den = w @ jnp.swapaxes(f64(v), 1, 2), jnp.sum(w, -1, keepdims=True)
    low = jnp.zeros(den.shape, bool)
    if not attn.positive:   # Jensen's floor on the denominator (as `attention` above), written again
        x, y = map(f64, attn.inputs(q, k))
        vv = jnp.swapaxes(f64(v), 1, 2)
        kf = jnp.broadcast_to(keep, w.shape).astype(jnp.float64)
        n = jnp.sum(kf, -1, keepdims=True)
        bound = jnp.where(n > 0, n * jnp.exp(jnp.sum(x * (kf @ y) / jnp.maximum(n, 1.0), -1, keepdims=True)), 0.0)
        low = (n > 0) & (den < bound)
        num = jnp.where(low, num + (bound - den) * (kf @ vv) / jnp.maximum(n, 1.0), num)
        den = jnp.where(low, bound, den)
        seen = kf[..., None] > 0
        lo = jnp.min(jnp.where(seen, vv[:, :, None], jnp.inf), axis=-2)
        hi = jnp.max(jnp.where(seen, vv[:, :, None], -jnp.inf), axis=-2)
    out = jnp.where(den != 0, num / jnp.where(den == 0, 1.0, den), 0.0)
    if not attn.positive:
        out = jnp.where(low, jnp.clip(out, lo, hi), out)
    return jnp.swapaxes(out, 1, 2)
