"""Query/key normalisation (favor.attention.qknorm) in favor's layer and in the NNX drop-in: against an
explicit float64 computation written here, its radius bounded with finite gradients, and uptraining a
source without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor import attention, models, uptrain
from favor.attention import qknorm
from favor.models.layers import SelfAttention


def _layer(kind="softmax", **qk):
    opts = {} if kind in ("softmax", "relu", "elu") else {"num_features": 64}
    return SelfAttention(16, 2, {"kind": kind, **opts, **qk}, rngs=nnx.Rngs(0))


def _np(a):
    return np.asarray(a, np.float64)


def _explicit_softmax(layer, x, qk):
    """The layer's attention written out in float64: projections, each head's queries and keys
    normalised (qk), softmax over keys, output projection."""
    xs = _np(x)
    proj = lambda d: xs @ _np(d.kernel[...]) + _np(d.bias[...])
    b, l, _ = xs.shape
    heads = lambda a: a.reshape(b, l, 2, 8)
    q, k, v = heads(proj(layer.query)), heads(proj(layer.key)), heads(proj(layer.value))
    q, k = qk(q, k)
    logits = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(8)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("bhij,bjhd->bihd", w, v).reshape(b, l, 16)
    return out @ _np(layer.out.kernel[...]) + _np(layer.out.bias[...])


def test_l2_softmax_equals_the_explicit_normalised_softmax():
    """qk_norm="l2": logits r²·cos θ with r the head's radius (set apart per head here), softmax alike."""
    layer = _layer(qk_norm="l2", qk_radius=1.3, qk_radius_max=2.5)
    layer.qk_logit[...] = jnp.asarray([qknorm.initial_logit(1.3, 2.5), qknorm.initial_logit(0.6, 2.5)])
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 16)) * 3.0
    radii = np.array([1.3, 0.6])
    np.testing.assert_allclose(_np(layer.radius()), radii, rtol=1e-6)

    def sphere(q, k):
        unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
        scale = radii[None, None, :, None] * 8 ** 0.25
        return unit(q) * scale, unit(k) * scale

    np.testing.assert_allclose(_np(layer(x)), _explicit_softmax(layer, x, sphere), rtol=2e-5, atol=2e-5)


def test_layernorm_softmax_equals_the_explicit_qk_layernorm():
    layer = _layer(qk_norm="layernorm")
    layer.query_norm.scale[...] = jnp.linspace(0.5, 1.5, 8)
    layer.key_norm.bias[...] = jnp.linspace(-0.2, 0.2, 8)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 16))

    def ln(a, norm):
        mu, var = a.mean(-1, keepdims=True), a.var(-1, keepdims=True)
        return (a - mu) / np.sqrt(var + 1e-6) * _np(norm.scale[...]) + _np(norm.bias[...])

    expect = _explicit_softmax(layer, x, lambda q, k: (ln(q, layer.query_norm), ln(k, layer.key_norm)))
    np.testing.assert_allclose(_np(layer(x)), expect, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", ["favor+", "favor", "hrf", "elu"])
def test_every_kind_sees_queries_and_keys_on_the_sphere(kind):
    """What the kind is handed: rows of norm r·D^(1/4), i.e. kernel inputs x = q·D^(−1/4) of norm r
    (the sphere S(r) of the HRF theorems), whatever the projections' scale."""
    layer = _layer(kind, qk_norm="l2", qk_radius=1.5)
    x = 10.0 * jax.random.normal(jax.random.PRNGKey(2), (1, 6, 16))
    q, k, _ = layer.project(x)
    for a in (q, k):
        np.testing.assert_allclose(np.linalg.norm(_np(a), axis=-1) * 8 ** -0.25, 1.5, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(layer(x))))


def test_the_radius_stays_bounded_with_finite_gradients():
    """rmax·sigmoid(ρ): in (0, rmax) at any ρ, a gradient everywhere (a clip would have none at the
    bound), and the initial radius where asked."""
    layer = _layer("favor", qk_norm="l2", qk_radius=1.0, qk_radius_max=2.0)
    np.testing.assert_allclose(_np(layer.radius()), 1.0, rtol=1e-6)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 6, 16))
    graph = nnx.split(layer, nnx.Param, ...)[0]
    # one compiled gradient for the three radii (run eagerly, its operations compile one by one)
    grad = jax.jit(jax.grad(lambda p, rest: jnp.sum(nnx.merge(graph, p, rest)(x) ** 2)))
    for rho in (-30.0, 0.0, 30.0):
        layer.qk_logit[...] = jnp.full((2,), rho)
        r = _np(layer.radius())
        assert np.all((r >= 0) & (r <= 2.0))
        _, params, rest = nnx.split(layer, nnx.Param, ...)
        grads = grad(params, rest)
        assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


def test_the_drop_in_puts_queries_and_keys_on_a_fixed_sphere():
    """attention_fn(kind, qk_norm="l2", qk_radius=r) equals the kind on explicitly normalised inputs;
    "layernorm" points to nnx.MultiHeadAttention(normalize_qk=True)."""
    q, k, v = (jax.random.normal(key, (1, 5, 2, 8)) * 4.0 for key in jax.random.split(jax.random.PRNGKey(4), 3))
    unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True) * 1.2 * 8 ** 0.25
    for kind in ("softmax", "favor+"):
        fn = attention.attention_fn(kind, qk_norm="l2", qk_radius=1.2, **({} if kind == "softmax" else
                                                                            {"num_features": 32}))
        got = fn(q, k, v, deterministic=True)
        if kind == "softmax":
            expect = jax.nn.dot_product_attention(unit(q), unit(k), v)
        else:
            expect = attention.get(kind, num_features=32)(unit(q), unit(k), v)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expect), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="normalize_qk=True"):
        attention.attention_fn("favor+", qk_norm="layernorm")


def test_bad_options_name_the_key_and_what_is_allowed():
    with pytest.raises(ValueError, match="unknown qk_norm 'l1'; valid: '', 'l2', 'layernorm'"):
        models.get("vit", "tiny", attention={"kind": "favor+", "qk_norm": "l1"})
    with pytest.raises(ValueError, match="qk_radius must be below qk_radius_max"):
        models.get("vit", "tiny", attention={"kind": "softmax", "qk_norm": "l2", "qk_radius": 2.0})


def test_a_source_without_qk_norm_uptrains_into_one_with_it():
    """The new model's qk_norm parameters start at their init (named as fresh); every other missing
    parameter is still an error."""
    want = {"layers.0.attention.query.kernel": ((4, 4), np.float32),
            "layers.0.attention.qk_logit": ((2,), np.float32),
            "layers.0.attention.query_norm.scale": ((2,), np.float32)}
    have = {"layers.0.attention.query.kernel": ((4, 4), np.float32)}
    load, fresh, dropped = uptrain.match(have, want, "run:src")
    assert load == ["layers.0.attention.query.kernel"]
    assert fresh == ["layers.0.attention.qk_logit", "layers.0.attention.query_norm.scale"] and dropped == []
    with pytest.raises(ValueError, match="layers.0.mlp.kernel"):
        uptrain.match(have, {**want, "layers.0.mlp.kernel": ((4, 4), np.float32)}, "run:src")
