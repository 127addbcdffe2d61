"""Linear attention over every kind: exactness against the explicit L×L form, masks, causal,
decoding, gradients, numerics, redraw schedules, and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from favor import attention
from favor.attention import linear

KINDS = attention.names()
RF_KINDS = [k for k in KINDS if isinstance(attention.get(k), attention.RandomFeatureAttention)]
SMALL = {"num_features": 16}


def make(kind, **opts):
    base = dict(SMALL) if kind in RF_KINDS and kind != "hrf" else {}
    if kind == "hrf":
        base = {"num_features": 8, "num_lambda_features": 4}
    return attention.get(kind, **{**base, **opts})


def qkv(b=2, lq=9, lk=9, h=2, d=8, dv=5, scale=0.6, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = scale * jax.random.normal(ks[0], (b, lq, h, d))
    k = scale * jax.random.normal(ks[1], (b, lk, h, d))
    v = jax.random.normal(ks[2], (b, lk, h, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def key_mask(b=2, lk=9):
    m = np.ones((b, lk), bool)
    m[0, -3:] = False
    m[1, 2] = False
    return jnp.asarray(m)


def explicit_weights(attn, q, k, mask, rng, causal):
    """The same estimator as an explicit [B, H, Lq, Lk] matrix (same fit, same ω)."""
    if isinstance(attn, attention.RandomFeatureAttention):
        ctx = attn.context(q, k, mask, rng, None, attn._query_mask(q, k, mask))
        x, y = attn.scaled(q, k)
        a = attn.mech.estimate(x, y, ctx.draw, ctx.params)
    else:
        fq, fk = attn.features(q, k, None, rng, None)
        a = jnp.einsum("bhif,bhjf->bhij", fq, fk)
    if mask is not None:
        a = jnp.where(mask[:, None, None, :], a, 0.0)
    if causal:
        a = jnp.where(jnp.tril(jnp.ones(a.shape[-2:], bool)), a, 0.0)
    return a


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "softmax"])
def test_equals_explicit_lxl_form(kind, causal):
    attn = make(kind, chunk_size=4)
    q, k, v = qkv()
    mask = key_mask()
    rng = jax.random.PRNGKey(3)
    out = attn(q, k, v, mask=mask, causal=causal, rng=rng)
    a = explicit_weights(attn, q, k, mask, rng, causal)
    den = linear.guard(jnp.swapaxes(jnp.sum(a, -1), 1, 2), attn.positive)
    ref = jnp.einsum("bhij,bjhd->bihd", a, v) / den[..., None]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_masked_keys_have_no_influence(kind, causal):
    attn = make(kind)
    q, k, v = qkv()
    mask = key_mask()
    rng = jax.random.PRNGKey(4)
    out = attn(q, k, v, mask=mask, causal=causal, rng=rng)
    junk = ~np.asarray(mask)[:, :, None, None]
    k2 = jnp.where(junk, 30.0, k)
    v2 = jnp.where(junk, -1e3, v)
    out2 = attn(q, k2, v2, mask=mask, causal=causal, rng=rng)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_all_padding_row_is_finite(kind):
    attn = make(kind)
    q, k, v = qkv()
    mask = jnp.asarray(np.array([[True] * 9, [False] * 9]))
    for causal in (False, True):
        out = attn(q, k, v, mask=mask, causal=causal, rng=jax.random.PRNGKey(0))
        assert np.all(np.isfinite(np.asarray(out))), (kind, causal)


@pytest.mark.parametrize("kind", KINDS)
def test_cross_attention_shapes(kind):
    attn = make(kind)
    q, k, v = qkv(lq=5, lk=11, dv=3)
    out = attn(q, k, v, mask=key_mask(lk=11), rng=jax.random.PRNGKey(0))
    assert out.shape == (2, 5, 2, 3) and np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("kind", RF_KINDS)
def test_decoding_step_equals_causal_pass(kind):
    attn = make(kind, chunk_size=4)
    q, k, v = qkv(lq=10, lk=10)
    rng = jax.random.PRNGKey(5)
    ctx = attn.context(q, k, None, rng)
    fq, fk = attn.stabilised_features(q, k, None, ctx)
    full = jnp.swapaxes(linear.causal(fq, fk, jnp.swapaxes(v, 1, 2), attn.positive, 4), 1, 2)
    state = attn.decode_init(2, 2, v.shape[-1])
    outs = []
    for t in range(10):
        o, state = attn.decode_step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], ctx)
        outs.append(o)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), rtol=2e-3, atol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["favor+", "favor++", "favor#", "simrf"])
def test_many_features_match_softmax(kind):
    """M = 4096 orthogonal/simplex features on small-norm inputs: close to exact attention."""
    attn = attention.get(kind, num_features=4096)
    q, k, v = qkv(b=1, lq=16, lk=16, h=2, d=16, scale=0.3)
    exact = attention.get("softmax")(q, k, v)
    for causal in (False, True):
        out = attn(q, k, v, causal=causal, rng=jax.random.PRNGKey(0))
        ref = attention.get("softmax")(q, k, v, causal=causal)
        err = float(jnp.max(jnp.abs(out - ref)))
        assert err < 0.05, (kind, causal, err)
    assert exact.shape == out.shape


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_finite_differences(kind):
    opts = {"redraw": "fixed"}
    if kind in RF_KINDS:
        opts["fit_gradients"] = True   # finite differences see the fit move, so the gradient must too
    attn = make(kind, **(opts if kind in RF_KINDS else {}))
    q, k, v = qkv(b=1, lq=5, lk=5, h=1, d=4, dv=2, seed=7)
    mask = jnp.asarray([[True, True, True, True, False]])

    def f(q, k, v):
        return attn(q, k, v, mask=mask, rng=None)

    out = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in out)
    if kind == "hrf":
        # sign features are piecewise constant; finite differences across a flip are meaningless
        check_grads(lambda v: f(q, k, v), (v,), order=1, modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)
    else:
        check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-3, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_large_norms_no_nan(kind):
    """||q||, ||k|| up to 10·√D in bf16: finite outputs and gradients."""
    attn = make(kind)
    d = 16
    q, k, v = qkv(b=1, lq=8, lk=8, h=2, d=d, scale=1.0, seed=9)
    norms = jnp.linspace(1.0, 10.0 * d ** 0.5, 8)[None, :, None, None]
    q = (q / jnp.linalg.norm(q, axis=-1, keepdims=True) * norms).astype(jnp.bfloat16)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True) * norms).astype(jnp.bfloat16)
    v = v.astype(jnp.bfloat16)
    for causal in (False, True):
        out = attn(q, k, v, causal=causal, rng=jax.random.PRNGKey(1))
        assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32))), (kind, causal)
        g = jax.grad(lambda q: jnp.sum(attn(q, k, v, causal=causal, rng=jax.random.PRNGKey(1))
                                       .astype(jnp.float32)))(q)
        assert np.all(np.isfinite(np.asarray(g, np.float32))), (kind, causal)


def test_redraw_schedules():
    q, k, v = qkv()
    r1, r2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    step = attention.get("favor+", num_features=8, redraw="step")
    assert not np.allclose(step(q, k, v, rng=r1), step(q, k, v, rng=r2))
    np.testing.assert_array_equal(step(q, k, v), step(q, k, v))          # evaluation: deterministic
    fixed = attention.get("favor+", num_features=8, redraw="fixed")
    np.testing.assert_array_equal(fixed(q, k, v, rng=r1), fixed(q, k, v, rng=r2))
    every = attention.get("favor+", num_features=8, redraw="every:3")
    a, b, c = (every(q, k, v, rng=r1, step=s) for s in (3, 5, 6))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    with pytest.raises(ValueError, match="needs the step"):
        every(q, k, v, rng=r1)


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="unknown attention kind 'performer'.*favor\\+\\+"):
        attention.get("performer")
    with pytest.raises(ValueError, match="unknown option.*'num_feature'.*num_features"):
        attention.get("favor+", num_feature=4)
    with pytest.raises(ValueError, match="unknown redraw 'sometimes'"):
        attention.get("favor+", redraw="sometimes")
    with pytest.raises(ValueError, match="unknown variant 'derf'"):
        attention.get("favor#", variant="derf")
    with pytest.raises(ValueError, match="chunk_size must be a positive integer; got 0"):
        attention.get("elu", chunk_size=0)
    with pytest.raises(ValueError, match="unknown coupling 'qmc'"):
        attention.get("favor++", coupling="qmc")
    q, k, v = qkv()
    with pytest.raises(ValueError, match="key-padding mask"):
        attention.get("favor+")(q, k, v, mask=jnp.ones((2, 9, 9), bool))
    with pytest.raises(ValueError, match="q \\[B, Lq, H, D\\]"):
        attention.get("softmax")(q[0], k, v)


def test_jit_and_grad_every_kind():
    q, k, v = qkv()
    mask = key_mask()
    for kind in KINDS:
        attn = make(kind)
        f = jax.jit(lambda q, k, v, r: jnp.sum(attn(q, k, v, mask=mask, rng=r) ** 2))
        g = jax.jit(jax.grad(lambda q, k, v, r: jnp.sum(attn(q, k, v, mask=mask, rng=r) ** 2)))
        assert np.isfinite(float(f(q, k, v, jax.random.PRNGKey(0))))
        assert np.all(np.isfinite(np.asarray(g(q, k, v, jax.random.PRNGKey(0)))))


@pytest.mark.parametrize("kind", KINDS)
def test_nnx_multihead_attention_dropin(kind):
    """nnx.MultiHeadAttention(attention_fn=...) with every kind, padding mask, under jit and grad."""
    from flax import nnx

    opts = {} if kind not in RF_KINDS else ({"num_features": 8, "num_lambda_features": 2} if kind == "hrf"
                                             else {"num_features": 16})
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False,
                                 attention_fn=attention.attention_fn(kind, **opts), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 8))
    valid = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], bool)
    mask = nnx.make_attention_mask(valid, valid)

    def loss(m, x):
        return jnp.sum(m(x, mask=mask, deterministic=True) ** 2)

    val, grads = nnx.jit(nnx.value_and_grad(loss))(mha, x)
    assert np.isfinite(float(val))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    # padded positions do not change the valid outputs
    x2 = x.at[1, 4:].set(7.0)
    out, out2 = mha(x, mask=mask, deterministic=True), mha(x2, mask=mask, deterministic=True)
    np.testing.assert_allclose(np.asarray(out[1, :4]), np.asarray(out2[1, :4]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["favor", "hrf"])
def test_exact_zero_queries_and_keys_have_finite_gradients(kind):
    # sin(0) = 0 exactly: log|0| must not put an infinite derivative into the backward pass
    attn = attention.get(kind, num_features=8)
    q = jnp.zeros((1, 6, 2, 8)).at[:, :3].set(0.3)
    k = jnp.zeros((1, 6, 2, 8)).at[:, 2:].set(-0.2)
    v = jnp.ones((1, 6, 2, 8))
    grads = jax.grad(lambda q, k: jnp.sum(attn(q, k, v, rng=jax.random.PRNGKey(0)) ** 2), (0, 1))(q, k)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
