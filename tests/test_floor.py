"""The floor on sign-indefinite denominators (trig, HRF): a bound the true denominator cannot go below,
rows above it untouched bit for bit, rows below it neither sign-flipped nor blown up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor import attention
from favor.attention import bidirectional, causal as causal_lib, floor as floor_lib, linear
from favor.attention.kinds import _to_bhld
from test_attention import options_key

SIGNED = ("favor", "hrf")


def _inputs(seed, b=2, l=24, h=2, d=8, dv=3, scale=1.0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = scale * jax.random.normal(ks[0], (b, l, h, d))
    k = scale * jax.random.normal(ks[1], (b, l, h, d))
    v = jax.random.normal(ks[2], (b, l, h, dv))
    mask = np.ones((b, l), bool)
    mask[0, -5:] = False
    mask[-1, 3] = False
    return q, k, v, jnp.asarray(mask)


@pytest.mark.parametrize("causal", [False, True])
def test_the_floor_is_below_every_true_denominator(causal):
    """exp(floor.log_i) ≤ Σ_j exp(x_iᵀy_j) over the keys query i sees (float64, written here), with
    padding, queries fewer than keys (causal), norms from 0.1 to 10·√D; and −inf for a query that sees
    no key; the value statistics are those of the same keys."""
    rng = np.random.default_rng(0)
    b, h, lq, lk, d, dv = 2, 2, 7, 11, 16, 3
    lq = lq if causal else lk
    norms = rng.uniform(0.1, 10.0 * d ** 0.5, (b, h, lk, 1)) * d ** -0.25
    y = rng.normal(size=(b, h, lk, d))
    y = y / np.linalg.norm(y, axis=-1, keepdims=True) * norms
    x = rng.normal(size=(b, h, lq, d)) * rng.uniform(0.1, 3.0, (b, h, lq, 1))
    v = rng.normal(size=(b, h, lk, dv))
    valid = np.ones((b, lk), bool)
    valid[0, :4] = False                 # the first causal queries see no key
    valid[1, 5] = False
    fl = floor_lib.jensen_floor(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32), jnp.asarray(v, jnp.float32),
                             jnp.asarray(valid), causal)
    log_floor = np.asarray(fl.log, np.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                seen = valid[bi].copy()
                if causal:
                    seen[i + lk - lq + 1:] = False
                if not seen.any():
                    assert log_floor[bi, hi, i] == -np.inf
                    continue
                logits = y[bi, hi, seen] @ x[bi, hi, i]
                true = np.log(np.sum(np.exp(logits - logits.max()))) + logits.max()
                assert log_floor[bi, hi, i] <= true + 1e-4 * max(1.0, abs(true)), (bi, hi, i)
                vs = v[bi, hi, seen]
                row = lambda a: np.asarray(a, np.float64)[bi, hi, i if a.shape[2] > 1 else 0]
                np.testing.assert_allclose(row(fl.mean), vs.mean(0), rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(row(fl.low), vs.min(0), rtol=1e-6)
                np.testing.assert_allclose(row(fl.high), vs.max(0), rtol=1e-6)


_LAYERS = {}


def _layer(kind, chunk=4, **opts):
    """One instance per kind and options for the module: the eager passes compile per feature map (a
    bound method, equal only for the same instance) and shape, so tests that share one share those."""
    key = (kind, chunk, options_key(opts))
    if key not in _LAYERS:
        _LAYERS[key] = attention.get(kind, num_features=32, chunk_size=chunk, **opts)
    return _LAYERS[key]


def _passes(kind, q, k, v, mask, causal, chunk=4, **opts):
    """The layer's pass with its floor and the same pass without one (the plain ratio), and the rows
    whose estimated denominator is below the floor."""
    attn = _layer(kind, chunk, **opts)

    @jax.jit
    def prepare(q, k, v, mask):
        """As one compiled program; eager, each operation compiles on its own."""
        ctx = attn.context(q, k, mask, jax.random.PRNGKey(1), None, mask, None, None, causal)
        x, y = attn.inputs(q, k)
        vv = _to_bhld(v)
        return ctx, x, y, vv, attn.floor(x, y, vv, mask, causal, ctx)

    ctx, x, y, vv, fl = prepare(q, k, v, mask)
    if causal:
        run = lambda f: causal_lib.causal_maps(attn.query_map, attn.key_map, ctx, x, y, vv, mask, False, chunk,
                                           "auto", None, f)
        sums, scale = causal_lib.causal_sums(attn.query_map, attn.key_map, ctx, x, y, linear.ones_column(vv),
                                               mask, chunk, "auto", None)
    else:
        run = lambda f: bidirectional.bidirectional_maps(attn.query_map, attn.key_map, ctx, x, y, vv, mask, False, chunk, f)
        sums, scale = _bidirectional_sums(attn, ctx, x, y, vv, mask)
    low = floor_lib.below_floor(sums, scale, fl)
    return np.asarray(run(fl)), np.asarray(run(None)), np.asarray(low), fl, np.asarray(sums[..., -1])


def _bidirectional_sums(attn, ctx, x, y, vv, mask):
    """The un-normalised bidirectional sums on each query's scale, as the pass forms them."""
    (lq, sq), (lk, sk) = attn.query_map(ctx, x), attn.key_map(ctx, y)
    lk = jnp.where(mask[:, None, :, None], lk, -jnp.inf)
    tau = jnp.max(lk, axis=-2, keepdims=True)
    w = jnp.exp(lk - tau)
    total = jnp.einsum("bhld,bhlf->bhdf", linear.ones_column(vv) * w, sk)
    lqt = lq + tau
    scale = jnp.max(lqt, axis=-1)
    out = jnp.einsum("bhlf,bhdf->bhld", sq, total) * jnp.exp(lqt - scale[..., None])
    return out, scale


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", SIGNED)
def test_rows_above_the_floor_are_untouched_bit_for_bit(kind, causal):
    """At norms where some estimates fall below the floor and most do not: every row above it equals the
    plain ratio exactly; every row below it differs from it and lies in its values' range."""
    q, k, v, mask = _inputs(3, scale=1.4)
    floored, plain, low, fl, _ = _passes(kind, q, k, v, mask, causal)  # [B, H, L, Dv], low [B, H, L]
    assert 0 < low.sum() < low.size, low.sum()                       # both kinds of rows are here
    np.testing.assert_array_equal(floored[~low], plain[~low])
    assert not np.allclose(floored[low], plain[low])
    lo = np.broadcast_to(fl.low, floored.shape)
    hi = np.broadcast_to(fl.high, floored.shape)
    assert np.all((floored[low] >= lo[low]) & (floored[low] <= hi[low]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", SIGNED)
def test_rows_with_negative_denominators_are_not_sign_flipped(kind, causal):
    """Values all in [1, 2], so every true output is in [1, 2]: at norms where many estimated
    denominators are negative (the plain ratio puts those rows far outside [1, 2], sign-flipped), the
    floored layer puts each of them inside the range, and its gradients are finite. (Rows above the floor
    keep their estimate, which may itself fall outside the range: the floor bounds the denominator, not
    the numerator's noise.)"""
    q, k, v, mask = _inputs(5, scale=2.5)
    v = 1.0 + jax.nn.sigmoid(v)
    floored, plain, low, _, den = _passes(kind, q, k, v, mask, causal)   # [B, H, L, Dv]; den [B, H, L]
    negative = den < 0
    assert negative.sum() >= 5 and np.all(low[negative])
    assert np.any((plain[negative] < 1.0) | (plain[negative] > 2.0))   # the failure prevented
    assert np.all((floored[negative] >= 1.0 - 1e-5) & (floored[negative] <= 2.0 + 1e-5))
    attn = _layer(kind)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v, mask=mask, causal=causal) ** 2)
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


@pytest.mark.parametrize("kind", SIGNED)
def test_decoding_applies_the_same_floor(kind):
    """Token-by-token decoding keeps the floor's sums in its state and equals the causal pass at norms
    where some rows are floored."""
    q, k, v, _ = _inputs(3, b=1, l=12, scale=1.4)
    attn = _layer(kind)
    full = np.asarray(jax.jit(lambda q, k, v: attn(q, k, v, causal=True))(q, k, v))     # one program, not op by op
    ctx = jax.jit(lambda: attn.decode_context(q.shape[-1]))()
    state = jax.jit(lambda: attn.decode_init(1, q.shape[2], q.shape[-1], v.shape[-1]))()
    outs = []
    step = jax.jit(attn.decode_step)           # one program a step, as generation runs it
    for t in range(q.shape[1]):
        out, state = step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], ctx)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=2e-4, atol=2e-5)


def test_hrf_rows_whose_lambda_is_one_do_not_cancel():
    """hrf-angular's indicator features weight each base term by exactly λ̂ or 1 − λ̂: where every key has
    λ̂ = 1 the trig part is absent, not the difference of two equal float32 sums (Lemma 2.3's form left
    noise up to 3.7 in the outputs here, and the causal pass and decoding disagreed by that much)."""
    rng = np.random.default_rng(13)
    b, l, h, d = 1, 8, 1, 8
    q = (rng.normal(size=(b, l, h, d)) * 2.3).astype(np.float32)
    k = (rng.normal(size=(b, l, h, d)) * 2.3).astype(np.float32)
    v = rng.normal(size=(b, l, h, 2)).astype(np.float32)
    attn = _layer("hrf")
    full = np.asarray(jax.jit(lambda q, k, v: attn(q, k, v, causal=True))(q, k, v))     # one program, not op by op
    ctx, state = jax.jit(lambda: (attn.decode_context(d), attn.decode_init(b, h, d, 2)))()
    outs = []
    step = jax.jit(attn.decode_step)           # one program a step, as generation runs it
    for t in range(l):
        out, state = step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], ctx)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)
    # the features' inner products against Theorem 3.1's estimator written out in float64
    x = np.asarray(q[0, :, 0], np.float64) * d ** -0.25
    y = np.asarray(k[0, :, 0], np.float64) * d ** -0.25
    w = ctx.draw
    s = lambda u, om: np.einsum("ld,md->lm", u, np.asarray(om, np.float64))
    lam = np.mean(np.sign(s(x, w.lam.omega))[:, None, :] != np.sign(s(y, w.lam.omega))[None, :, :], -1)
    z = s(x, w.pos.omega)[:, None, :] + s(y, w.pos.omega)[None, :, :]
    norms = 0.5 * (np.sum(x * x, -1)[:, None] + np.sum(y * y, -1)[None, :])
    pos = np.mean(np.exp(z) + np.exp(-z), -1) / 2 * np.exp(-norms)
    t = s(x, w.trig.omega)[:, None, :] - s(y, w.trig.omega)[None, :, :]
    trig = np.mean(np.cos(t), -1) * np.exp(norms)
    expect = lam * pos + (1 - lam) * trig
    (lq, sq), (lk, sk) = jax.jit(attn.log_maps)(q, k, ctx)
    fq = np.exp(np.asarray(lq, np.float64)) * np.asarray(sq, np.float64)
    fk = np.exp(np.asarray(lk, np.float64)) * np.asarray(sk, np.float64)
    got = np.einsum("lf,mf->lm", fq[0, 0], fk[0, 0])
    assert np.any(lam == 1.0)
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-6 * np.abs(expect).max())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", SIGNED)
def test_identical_keys_give_the_mean_at_large_norms(kind, causal):
    """Identical keys, D = 16, ‖q‖ = ‖k‖ = 8, 16, 24 (2–6·√D), a padded key: every output is the mean of
    the values its query sees (float64, written here) to 1e-4 of the values' size. In exact arithmetic
    any estimate gives it; in float32 the floored rows' residual Σ_j ŵ_ij (v_j − v̄) is rounding noise
    over a bound far below the estimate's mass, which reached 3 in these outputs before the residual was
    shrunk by its rounding bound (floored_ratio)."""
    b, l, h, d, dv = 1, 32, 2, 16, 3
    mask = jnp.ones((b, l), bool).at[0, 5].set(False)
    attn = _layer(kind, chunk=8)
    run = jax.jit(lambda q, k, v: attn(q, k, v, mask=mask, causal=causal))
    below = jax.jit(lambda q, k: attn.denominator_rows(q, k, mask, causal, attn.context(
        q, k, mask, None, None, mask, None, None, causal))[1])         # one program, not op by op
    vmask = np.asarray(mask)[..., None, None]
    floored = 0
    for seed, norm in enumerate((8.0, 16.0, 24.0)):
        ks = jax.random.split(jax.random.PRNGKey(seed), 3)
        unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
        q = unit(jax.random.normal(ks[0], (b, l, h, d))) * norm
        k = jnp.broadcast_to(unit(jax.random.normal(ks[1], (b, 1, h, d))) * norm, (b, l, h, d))
        v = 3.0 * jax.random.normal(ks[2], (b, l, h, dv))
        vv = np.where(vmask, np.asarray(v, np.float64), 0.0)
        if causal:
            expect = np.cumsum(vv, 1) / np.cumsum(np.asarray(mask), 1)[..., None, None]
        else:
            expect = np.broadcast_to(vv.sum(1, keepdims=True) / np.asarray(mask).sum(), vv.shape)
        out = np.asarray(run(q, k, v), np.float64)
        np.testing.assert_allclose(out, expect, atol=1e-4 * np.abs(vv).max(), rtol=0)
        floored += int(np.asarray(below(q, k)).sum())
    assert floored > 0              # the rows the fix is about are among them


def test_a_floored_row_whose_plain_ratio_overflows_has_finite_gradients():
    """A floored row with a denominator far below its numerator (num/den beyond float32's range): the
    discarded plain ratio must not turn the row's cotangent into NaN."""
    out = jnp.asarray([[100.0, 1e-37]])
    fl = floor_lib.Floor(log=jnp.asarray([0.0]), mean=jnp.asarray([[0.5]]), low=jnp.asarray([[0.0]]),
                      high=jnp.asarray([[1.0]]), log_mass=jnp.asarray([3.0]))
    scale = jnp.asarray([0.0])
    grad = jax.jit(jax.grad(lambda o: jnp.sum(floor_lib.floored_ratio(o, False, scale, fl) ** 2)))(out)
    assert np.all(np.isfinite(np.asarray(grad))), grad
