"""Unbiasedness of every mechanism and coupling; empirical variance against the analytic formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor import kernels
from conftest import assert_unbiased, assert_variance_matches, pairs, repeated_estimates

REPEATS = 20000
GAUSSIAN = ["positive", "gerf", "oprf", "saderf", "aderf", "sderf"]
MECH_OPTIONS = [(n, {}) for n in kernels.names()] + [
    ("positive", {"antithetic": True}),
    ("gerf", {"a": -0.2}),
    ("hrf-gaussian", {"sigma": 0.7, "num_lambda_features": 3}),
    ("hrf-angular", {"num_lambda_features": 3}),
] + [(n, {"importance_sampling": True}) for n in GAUSSIAN]


def _id(p):
    name, opts = p
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


@pytest.mark.parametrize("name,opts", MECH_OPTIONS, ids=map(_id, MECH_OPTIONS))
def test_unbiased_and_variance_iid(name, opts):
    mech = kernels.get(name, **opts)
    x, y = pairs(seed=1)
    params = mech.fit(x, y)
    m = 2
    est = repeated_estimates(mech, x, y, params, m, REPEATS, seed=7)
    exact = np.exp(np.asarray(x @ y.T, np.float64))
    assert_unbiased(est, exact, _id((name, opts)))
    analytic = np.asarray(mech.variance(x, y, params, m), np.float64)
    assert_variance_matches(est, analytic, _id((name, opts)))


COUPLED = ["trig", "positive", "oprf", "saderf", "aderf", "sderf", "hrf-angular", "hrf-cluster"]


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["orthogonal", "simplex", "simplex+"])
@pytest.mark.parametrize("name", COUPLED)
def test_unbiased_under_coupling(name, coupling):
    mech = kernels.get(name)
    x, y = pairs(seed=2)
    params = mech.fit(x, y)
    d = x.shape[-1]
    # M = d + 2: one full coupled block plus a partial one
    est = repeated_estimates(mech, x, y, params, d + 2, 6000, seed=3, coupling=coupling)
    assert_unbiased(est, np.exp(np.asarray(x @ y.T, np.float64)), f"{name}/{coupling}")


def test_importance_sampling_unbiased_under_coupling():
    mech = kernels.get("oprf", importance_sampling=True)
    x, y = pairs(seed=4)
    params = mech.fit(x, y)
    est = repeated_estimates(mech, x, y, params, 6, 6000, seed=5, coupling="orthogonal")
    assert_unbiased(est, np.exp(np.asarray(x @ y.T, np.float64)), "oprf+IS/orthogonal")


@pytest.mark.parametrize("coupling", ["orthogonal", "simplex"])
def test_positive_mse_under_coupling_matches_theorem_3_2(coupling):
    """SimRF Thm 3.2 with eqs. 23/24: the empirical MSE of coupled positive RFs matches."""
    mech = kernels.get("positive")
    d = 8
    rng = np.random.default_rng(11)
    x = jnp.asarray(0.4 * rng.standard_normal((3, d)), jnp.float32)
    y = jnp.asarray(0.4 * rng.standard_normal((3, d)), jnp.float32)
    params = mech.fit(x, y)
    m = 2 * d + 3
    est = repeated_estimates(mech, x, y, params, m, REPEATS, seed=13, coupling=coupling)
    analytic = np.asarray(mech.variance(x, y, params, m, coupling=coupling), np.float64)
    assert_variance_matches(est, analytic, f"positive/{coupling}")
    iid = np.asarray(mech.variance(x, y, params, m), np.float64)
    assert np.all(analytic < iid), "coupled projections must lower the MSE of positive RFs"


def test_discrete_draws_are_iid_only():
    mech = kernels.get("poisson")
    x, y = pairs()
    with pytest.raises(ValueError, match="iid only"):
        mech.draw(jax.random.PRNGKey(0), 4, mech.fit(x, y), coupling="orthogonal")


def test_importance_sampling_lowers_mean_variance_on_gaussian_data():
    """The proposal is optimal for E_x E_y Var under a Gaussian data model: on such data it wins."""
    rng = np.random.default_rng(3)
    d = 8
    x = jnp.asarray(0.4 * rng.standard_normal((300, d)) + 0.2, jnp.float32)
    y = jnp.asarray(0.3 * rng.standard_normal((300, d)) - 0.1, jnp.float32)
    for name in GAUSSIAN:
        plain, weighted = kernels.get(name), kernels.get(name, importance_sampling=True)
        v0 = np.asarray(plain.variance(x, y, plain.fit(x, y), 1)).mean()
        v1 = np.asarray(weighted.variance(x, y, weighted.fit(x, y), 1)).mean()
        assert v1 < v0, f"{name}: importance sampling raised the mean variance {v0} -> {v1}"


# -- the polynomial sin/cos of the trigonometric features (favor/kernels/sincos.py) ----------------------
def test_sincos_matches_float64_over_the_reduction_range_and_beyond():
    from favor.kernels.sincos import sincos
    xs = np.concatenate([np.linspace(-20, 20, 40001), np.linspace(-1e5, 1e5, 40001),
                         [0.0, np.pi / 4, np.pi / 2, -np.pi, 1e5 - 1, -1e5 + 1]]).astype(np.float32)
    s, c = (np.asarray(a, np.float64) for a in sincos(jnp.asarray(xs)))
    x64 = xs.astype(np.float64)
    assert np.max(np.abs(s - np.sin(x64))) < 2e-7 and np.max(np.abs(c - np.cos(x64))) < 2e-7
    big = np.array([3e5, -7e6, 1e9, 12.5], np.float32)     # past the exact reduction: the jnp fallback
    s, c = (np.asarray(a, np.float64) for a in sincos(jnp.asarray(big)))
    np.testing.assert_allclose(s, np.sin(big.astype(np.float64)), atol=1e-3)
    np.testing.assert_allclose(c, np.cos(big.astype(np.float64)), atol=1e-3)


def test_sincos_derivatives_are_cos_and_minus_sin():
    from favor.kernels.sincos import sincos
    x = jnp.linspace(-30.0, 30.0, 301)
    ds = jax.vmap(jax.grad(lambda t: sincos(t)[0]))(x)
    dc = jax.vmap(jax.grad(lambda t: sincos(t)[1]))(x)
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(ds), np.cos(x64), atol=2e-6)
    np.testing.assert_allclose(np.asarray(dc), -np.sin(x64), atol=2e-6)


@pytest.mark.parametrize("name", ["oprf", "saderf"])
def test_per_head_fit_with_a_shared_draw_matches_the_formula_at_large_norms(name):
    """A fit per batch element and head with one draw for all (the attention layers' case) takes the
    map whose per-head factors sit in the rows and whose projection matrix has no batch dims; its log
    features equal MATH.md's formula in float64, here at norms up to 10·√d, and that matrix is one
    operand of one matrix product."""
    from reference import exponential_log_features
    mech, d, m = kernels.get(name), 8, 16
    rng = np.random.default_rng(5)
    # per head a different spread, up to ||u|| = 10·√d, so A* and Ψ differ between heads
    spread = np.array([0.3, 1.0, 4.0, 10.0])[None, :, None, None]
    x = (rng.standard_normal((2, 4, 9, d)) * spread).astype(np.float32)
    y = (rng.standard_normal((2, 4, 11, d)) * spread * 0.5 + 0.2).astype(np.float32)
    params = mech.fit(jnp.asarray(x), jnp.asarray(y))
    draw = mech.draw(jax.random.PRNGKey(0), m, params, "orthogonal")
    assert draw.omega.shape == (m, d) and params.a.shape == (2, 4, d)
    omega, log_w = np.asarray(draw.omega, np.float64), np.asarray(draw.log_weights, np.float64)
    for u, t, maps in ((x, params.tq, mech.query_log_features), (y, params.tk, mech.key_log_features)):
        got = np.asarray(maps(jnp.asarray(u), draw, params)[0], np.float64)
        want = exponential_log_features(u.astype(np.float64), np.asarray(t, np.float64),
                                        np.asarray(params.a, np.float64), omega, log_w)
        # float32 sums of terms up to ~10²·d: the error scales with the largest term, not the result
        scale = 1.0 + np.abs(want).max(axis=-1, keepdims=True)
        np.testing.assert_allclose(got / scale, want / scale, atol=2e-6, err_msg=name)
    jaxpr = jax.make_jaxpr(lambda u: mech.query_log_features(u, draw, params)[0])(jnp.asarray(x)).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [tuple(e.invars[1].aval.shape) for e in dots] == [(d + 4, m)]
