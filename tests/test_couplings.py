"""Properties of the coupled Gaussian projections."""

import math

import jax
import numpy as np
import pytest
from scipy import stats

from favor import kernels
from favor.kernels import couplings


def test_orthogonal_rows_within_blocks():
    w = np.asarray(kernels.draw(jax.random.PRNGKey(0), 20, 8, "orthogonal").omega, np.float64)
    for b in range(2):
        blk = w[8 * b: 8 * b + 8]
        g = blk @ blk.T
        assert np.allclose(g - np.diag(np.diag(g)), 0.0, atol=1e-4)
    # rows across blocks are independent, not orthogonal
    assert abs(w[0] @ w[8]) > 1e-3


@pytest.mark.parametrize("coupling", kernels.COUPLINGS)
def test_groups_of_one_draw_are_independent_and_each_coupled(coupling):
    """projection_groups (HRF's three draws from one sample): each group has its size, is coupled within
    its own blocks (orthogonal: the rows of a block are orthogonal), and shares no block with another
    group: over many keys, pairs of rows from two groups (the first rows, and each group's last row with
    the next group's first) are uncorrelated in every coordinate and their inner product has the second
    moment of independent Gaussian rows (within 5 standard errors)."""
    d, sizes, reps = 4, (6, 4, 3), 2000
    keys = jax.random.split(jax.random.PRNGKey(7), reps)
    groups = [np.asarray(g, np.float64)
              for g in jax.vmap(lambda k: couplings.projection_groups(k, sizes, d, coupling))(keys)]
    assert [g.shape for g in groups] == [(reps, m, d) for m in sizes]
    if coupling == "orthogonal":
        for g in groups:
            blk = g[0, :d] @ g[0, :d].T
            assert np.allclose(blk - np.diag(np.diag(blk)), 0.0, atol=1e-4)
    pairs = [(groups[0][:, 0], groups[1][:, 0])] + [(a[:, -1], b[:, 0]) for a, b in zip(groups, groups[1:])]
    for x, y in pairs:
        corr = np.einsum("ri,rj->ij", x, y) / reps                       # E[x_i y_j] = 0 if independent
        se = np.sqrt(np.einsum("ri,rj->ij", x ** 2, y ** 2) / reps - corr ** 2) / math.sqrt(reps)
        assert np.all(np.abs(corr) < 5 * se), corr / se
        # independent N(0, I_d) rows have E[(x·y)²] = d; two rows of one orthogonal block have x·y = 0 and
        # of one simplex block (x·y)² = |x|²|y|²/(d − 1)², so this tells a shared block apart
        dots = np.einsum("ri,ri->r", x, y) ** 2
        assert abs(dots.mean() - d) < 5 * dots.std() / math.sqrt(reps), dots.mean()


@pytest.mark.parametrize("d", [4, 16])
def test_simplex_angle(d):
    w = np.asarray(kernels.draw(jax.random.PRNGKey(1), d, d, "simplex").omega, np.float64)
    u = w / np.linalg.norm(w, axis=1, keepdims=True)
    g = u @ u.T
    off = g[~np.eye(d, dtype=bool)]
    assert np.allclose(off, -1.0 / (d - 1), atol=1e-5)
    assert np.allclose(np.arccos(off), math.acos(-1.0 / (d - 1)), atol=1e-3)


def test_simplex_plus_fixed_point():
    """SimRF+ (eq. 16): each row points away from the sum of the others, norms kept."""
    d = 8
    key = jax.random.PRNGKey(2)
    w = np.asarray(kernels.draw(key, d, d, "simplex+").omega, np.float64)
    ref = np.asarray(kernels.draw(key, d, d, "simplex").omega, np.float64)
    assert np.allclose(np.linalg.norm(w, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-5)
    for i in range(d):
        others = w.sum(0) - w[i]
        cos = w[i] @ others / (np.linalg.norm(w[i]) * np.linalg.norm(others))
        assert cos < -0.999, cos


@pytest.mark.parametrize("coupling", kernels.COUPLINGS)
def test_rows_marginally_gaussian(coupling):
    """KS tests: projections onto a fixed direction are N(0,1) and row norms are χ_d."""
    d, m, reps = 6, 6, 800
    keys = jax.random.split(jax.random.PRNGKey(3), reps)
    w = np.asarray(jax.vmap(lambda k: kernels.draw(k, m, d, coupling).omega)(keys), np.float64)
    rows = w[:, 2]                       # one row position, independent across draws
    e = np.ones(d) / math.sqrt(d)
    assert stats.kstest(rows @ e, "norm").pvalue > 1e-3
    assert stats.kstest(np.linalg.norm(rows, axis=1), stats.chi(d).cdf).pvalue > 1e-3


def test_haar_factor_has_no_sign_bias():
    """Without the sign correction QR's Q has a biased diagonal; Haar's is mean-zero."""
    reps, d = 4000, 4
    g = jax.random.normal(jax.random.PRNGKey(4), (reps, d, d))
    q = np.asarray(jax.vmap(couplings.haar_from_gaussian)(g), np.float64)
    diag = q[:, np.arange(d), np.arange(d)]
    se = diag.std(0) / math.sqrt(reps)
    assert np.all(np.abs(diag.mean(0)) < 5 * se), diag.mean(0)
    # and the raw QR factor of the same matrices does have the bias this guards against
    raw = np.asarray(jax.vmap(couplings.householder_qr)(g)[0])
    raw_diag = raw[:, np.arange(d), np.arange(d)]
    assert np.any(np.abs(raw_diag.mean(0)) > 10 * se)


def test_householder_qr_factorises():
    a = jax.random.normal(jax.random.PRNGKey(5), (7, 7))
    q, r_diag = couplings.householder_qr(a)
    q = np.asarray(q, np.float64)
    assert np.allclose(q @ q.T, np.eye(7), atol=1e-5)
    r = q.T @ np.asarray(a, np.float64)
    assert np.allclose(np.tril(r, -1), 0.0, atol=1e-5)
    assert np.allclose(np.diag(r), np.asarray(r_diag), atol=1e-5)


def test_draw_api_and_errors():
    p = kernels.draw(jax.random.PRNGKey(0), 5, 3, "iid")
    assert p.omega.shape == (5, 3) and p.log_weights.shape == (5,)
    assert np.all(np.asarray(p.log_weights) == 0)
    with pytest.raises(ValueError, match="unknown coupling 'sobol'.*iid, orthogonal, simplex, simplex\\+"):
        kernels.draw(jax.random.PRNGKey(0), 5, 3, "sobol")
    with pytest.raises(ValueError, match="num_features"):
        kernels.draw(jax.random.PRNGKey(0), 0, 3)
    with pytest.raises(ValueError, match="dim ≥ 2"):
        kernels.draw(jax.random.PRNGKey(0), 4, 1, "simplex")


def test_conformity_series_limits():
    """ρ(v) → 1 at v = 0 for every coupling, ρ_SimRF < ρ_ORF < ρ_IID for v > 0 (SimRF Thm 3.3)."""
    v = np.array([0.0, 0.3, 1.0, 2.0])
    d = 16
    iid = couplings.conformity(v, d, "iid")
    orf = couplings.conformity(v, d, "orthogonal")
    sim = couplings.conformity(v, d, "simplex")
    assert np.allclose([iid[0], orf[0], sim[0]], 1.0)
    assert np.all(sim[1:] < orf[1:]) and np.all(orf[1:] < iid[1:])
