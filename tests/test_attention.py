"""Linear attention over every kind, against an independent float64 computation of the same estimator
(tests/reference.py: shares only ω and the fitted parameters), with the invariants no correct
attention can break (on one kind per code path of the passes, FORMS), at hard inputs (norms up to 10·√D,
bf16, padding, L = 1), outputs and gradients.

Calls, gradients and repeatedly evaluated functions run under jax.jit, as in a model (`call`: one
program per instance and mode): run eagerly, each of their hundreds of operations is compiled as a
program of its own, which was most of this file's time. Eager calls are checked on their own
(test_the_passes_inline_into_a_traced_caller_and_compile_when_eager, the drop-in and redraw tests)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import reference
from favor import attention
from favor.attention import bidirectional, causal as causal_lib, linear

KINDS = attention.names()
LINEAR = [k for k in KINDS if k != "softmax"]
RF_KINDS = [k for k in KINDS if isinstance(attention.get(k), attention.RandomFeatureAttention)]
DATA_DEPENDENT = [k for k in RF_KINDS if attention.get(k).data_dependent]
# one kind per code path of the passes, for the invariants (the reference and gradient tests take every
# kind, and with them each feature map): softmax; exact-zero features (ReLU: the plain causal pass; ELU
# takes it too); signed with the floor (trig) and row-scaled signed (HRF); positive exponential drawn
# (FAVOR+; SimRF differs in its draw only) and fitted (FAVOR#; FAVOR++ fits the same way); learned
# (Hedgehog; T2R is the same learned form)
FORMS = ["softmax", "relu", "favor", "hrf", "favor+", "favor#", "hedgehog"]
LINEAR_FORMS = [k for k in FORMS if k != "softmax"]
assert set(FORMS) <= set(KINDS)


_MADE = {}


def options_key(opts):
    """Options as a cache key; each value's type is part of it (True is not 1)."""
    return tuple(sorted((k, type(v).__name__, v) for k, v in opts.items()))


def make(kind, **opts):
    """The test instance of `kind` with `opts`, one per kind and options for the test process. The eager
    passes compile per feature map and shape, and a feature map is a bound method, equal only for the
    same instance: tests that share an instance (and shapes) share those programs."""
    key = (kind, options_key(opts))
    if key not in _MADE:
        base = {"num_features": 16} if kind in RF_KINDS else {}
        if kind == "hrf":       # m = 8 frequencies per base estimator, n = 4 λ features: width 4·m·(n + 1)
            base = {"num_features": 160, "num_lambda_features": 4}
        accepted = attention.get(kind).OPTIONS                  # softmax takes none of the linear options
        _MADE[key] = attention.get(kind, **{k: v for k, v in {**base, **opts}.items() if k in accepted})
    return _MADE[key]


_PROGRAMS = {}


def grads_program(kind, causal, **opts):
    """(attention, program): program(q, k, v, mask, rng, stats, lin, sq) gives the outputs (float32)
    and d/d(q, k, v) of Σ lin·out + sq·out², under jax.jit. One program per kind, options and mode,
    kept for the test process (test_window's gradient checks come here too): the gradient tests below
    differ only in these arguments and in the weights, so they run the same compiled programs
    (compiling a value-and-gradient program is most of such a test's time)."""
    key = (kind, causal, options_key(opts))
    if key not in _PROGRAMS:
        attn = make(kind, **opts)

        @jax.jit
        def program(q, k, v, mask, rng, stats, lin, sq):
            def loss(q, k, v):
                out = attn(q, k, v, mask=mask, causal=causal, rng=rng, stats=stats).astype(jnp.float32)
                return jnp.sum(lin * out + sq * out ** 2), out
            (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
            return out, grads

        def run(q, k, v, mask, rng, stats, lin, sq):
            # weights as full float32 arrays: one signature, whichever weights a test gives
            shape = q.shape[:3] + v.shape[3:]
            lin, sq = (jnp.broadcast_to(jnp.asarray(w, jnp.float32), shape) for w in (lin, sq))
            return program(q, k, v, mask, rng, stats, lin, sq)

        _PROGRAMS[key] = attn, run
    return _PROGRAMS[key]


def qkv(b=2, lq=9, lk=9, h=2, d=8, dv=5, scale=0.6, seed=0, dtype=jnp.float32, norms=None):
    """q, k ~ N(0, scale²); or with `norms` (a [L] array) every row rescaled to that norm."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (b, lq, h, d))
    k = jax.random.normal(ks[1], (b, lk, h, d))
    v = jax.random.normal(ks[2], (b, lk, h, dv))
    if norms is None:
        q, k = scale * q, scale * k
    else:
        unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
        q = unit(q) * jnp.asarray(norms)[-lq:][None, :, None, None]
        k = unit(k) * jnp.asarray(norms)[None, :, None, None]
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def key_mask(b=2, lk=9):
    m = np.ones((b, lk), bool)
    m[0, -3:] = False
    m[1, 2] = False
    return jnp.asarray(m)


def calibration_stats(attn, d, h=2, seed=11, scale=0.6):
    """Fit statistics from data outside the attended sequence (what a causal call needs)."""
    if not attn.data_dependent:
        return None
    q, k, _ = qkv(b=2, lq=12, lk=12, h=h, d=d, scale=scale, seed=seed)
    return attn.statistics(q, k)


def context_of(attn, q, k, mask, rng, causal, stats=None, query_mask=None):
    if isinstance(attn, attention.RandomFeatureAttention):
        return attn.context(q, k, mask, rng, None, query_mask, None, stats, causal)
    return None


_CALLS = {}


def call(attn, causal):
    """f(q, k, v, mask, rng, stats) -> (attn's outputs, the context the call fixed: context_of), under one
    jax.jit per instance and mode, kept for the test process (with the instance, so that its id stays its
    own). Run eagerly, the context's fit and draw (and a signed kind's floor) compile operation by
    operation, a program for each operation and shape: most of the output tests' time."""
    key = (id(attn), causal)
    if key not in _CALLS:
        _CALLS[key] = attn, jax.jit(lambda q, k, v, mask, rng, stats: (
            attn(q, k, v, mask=mask, causal=causal, rng=rng, stats=stats),
            context_of(attn, q, k, mask, rng, causal, stats)))
    return _CALLS[key][1]


def check_against_reference(attn, q, k, v, mask, causal, rng=None, stats=None, rtol=2e-4, out_rtol=0.0):
    out, ctx = call(attn, causal)(q, k, v, mask, rng, stats)
    ref, cond = reference.attention(attn, q, k, v, ctx, mask, causal)
    out = np.asarray(out, np.float64)
    bound = rtol * cond[..., None] + out_rtol * np.abs(ref) + 1e-30
    bad = np.abs(out - ref) > bound
    assert not bad.any(), (attn.name, causal, float(np.max(np.abs(out - ref) / bound)), np.argwhere(bad)[:3])
    return out


def assert_close(attn, out, expect, q, k, v, mask=None, causal=False, stats=None, rng=None, ctx=None):
    """out ≈ expect to float32 rounding: 1e-4 relative for positive kinds; for sign-indefinite ones
    (trig, HRF), whose features cancel, rounding is amplified by the ratio's condition (reference.py),
    so the tolerance is that condition times float32's resolution. `ctx`: the call's context (`call`),
    else context_of's."""
    out, expect = np.asarray(out, np.float64), np.asarray(expect, np.float64)
    tol = 1e-5 + 1e-4 * np.abs(expect)
    if not getattr(attn, "positive", True):
        ctx = context_of(attn, q, k, mask, rng, causal, stats) if ctx is None else ctx
        _, cond = reference.attention(attn, q, k, v, ctx, mask, causal)
        tol = tol + 2e-4 * cond[..., None]
    bad = np.abs(out - expect) > tol
    assert not bad.any(), (attn.name, float(np.max(np.abs(out - expect) / tol)), np.argwhere(bad)[:3])


# -- against the float64 reference ------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", LINEAR)
def test_equals_float64_reference_with_padding(kind, causal):
    attn = make(kind, chunk_size=4)
    q, k, v = qkv()
    check_against_reference(attn, q, k, v, key_mask(), causal, rng=jax.random.PRNGKey(3),
                            stats=calibration_stats(attn, 8) if causal else None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", LINEAR)
def test_large_norms_equal_float64_reference(kind, causal, dtype):
    """||q||, ||k|| from 1 to 10·√D (D = 16) along the sequence, and the same reversed (a large first
    key: the first chunk's reference is then far below every later key)."""
    attn = make(kind, chunk_size=4)
    d, l = 16, 12
    norms = np.linspace(1.0, 10.0 * d ** 0.5, l)
    # bf16 only rounds the inputs (features are float32): the harder order suffices there
    for order in (norms, norms[::-1]) if dtype == jnp.float32 else (norms[::-1],):
        q, k, v = qkv(b=1, lq=l, lk=l, d=d, norms=order, dtype=dtype, seed=9)
        mask = jnp.ones((1, l), bool).at[0, 5].set(False)
        out = check_against_reference(attn, q, k, v, mask, causal, stats=calibration_stats(attn, d, h=2),
                                      out_rtol=1e-2 if dtype == jnp.bfloat16 else 0.0)
        assert np.all(np.isfinite(out))


@pytest.mark.parametrize("kind", LINEAR)
def test_bidirectional_chunks_with_whole_chunks_of_padding(kind):
    """The bidirectional pass runs keys and queries in chunks (a running key maximum; chunk_size=4 here,
    L = 13: three full chunks and one token): a first chunk that is all padding (the running maximum
    stays −inf through it), a padded middle chunk, a padded last token, and a row with no valid key,
    against the float64 reference."""
    attn = make(kind, chunk_size=4)
    q, k, v = qkv(b=3, lq=13, lk=13, seed=12)
    mask = np.ones((3, 13), bool)
    mask[0, :4] = False
    mask[1, 4:8] = False
    mask[1, 12] = False
    mask[2] = False
    out = check_against_reference(attn, q, k, v, jnp.asarray(mask), False, rng=jax.random.PRNGKey(2))
    np.testing.assert_array_equal(out[2], 0.0)


@pytest.mark.parametrize("kind", LINEAR)
def test_feature_maps_treat_rows_independently(kind):
    """The bidirectional pass applies query_map / key_map chunk by chunk: a row's features must come
    from its own input only (the fitted parameters and ω are fixed by the context)."""
    attn = make(kind)
    q, k, _ = qkv(lq=9, lk=9, seed=4)

    @jax.jit          # one program (eagerly every operation of the context and the maps is one of its own)
    def maps(q, k, mask, rng):
        ctx = context_of(attn, q, k, mask, rng, False)
        x, y = attn.inputs(q, k)
        return [(f(ctx, u), [f(ctx, u[:, :, i:i + 4]) for i in range(0, 9, 4)])
                for f, u in ((attn.query_map, x), (attn.key_map, y))]
    for whole, parts in maps(q, k, key_mask(), jax.random.PRNGKey(1)):
        for j, part in enumerate(zip(*parts)):
            if whole[j] is None:
                assert all(p is None for p in part)
                continue
            np.testing.assert_allclose(np.concatenate(part, 2), whole[j], rtol=1e-6, atol=1e-6)


# (relu, "exact") is left out: relu runs "auto" as "exact", the very program test_equals_float64_reference_
# with_padding[relu-True] already checks on these inputs
@pytest.mark.parametrize("kind,path", [(k, p) for k in ("favor+", "favor++", "favor", "relu") for p in ("fast", "exact")
                                       if (k, p) != ("relu", "exact")])
def test_both_causal_paths_equal_the_reference(kind, path):
    """Each causal algorithm alone (auto picks between them), on inputs where the fast one is exact.
    The shapes are test_equals_float64_reference_with_padding's (L = 9: two full chunks of 4 and a
    partial one), so the feature maps compile once for both tests."""
    attn = make(kind, chunk_size=4, causal_path=path)
    q, k, v = qkv()
    check_against_reference(attn, q, k, v, key_mask(), True, stats=calibration_stats(attn, 8))


def test_auto_takes_the_exact_path_outside_the_fast_paths_guarantee():
    attn = make("favor#", chunk_size=4, causal_path="fast")
    d, l = 16, 12
    q, k, v = qkv(b=1, lq=l, lk=l, d=d, norms=np.linspace(1.0, 40.0, l)[::-1], seed=9)
    stats = calibration_stats(attn, d)
    (lq, sq), (lk, sk) = attn.log_maps(q, k, attn.context(q, k, causal=True, stats=stats))
    # L = 12 is one span of the causal scan, whose reference is the first key: some key exceeds it by
    # more than the fast path's bound, so these inputs are outside its guarantee
    lk = np.asarray(lk, np.float64)[0]                                  # [H, L, F]
    exceed = np.max(lk - lk[:, :1], axis=(1, 2))
    assert causal_lib._span(4, l) == l and np.all(exceed > causal_lib.FAST_EXCEEDANCE), exceed
    auto = check_against_reference(make("favor#", chunk_size=4), q, k, v, None, True, stats=stats)
    exact, _ = call(make("favor#", chunk_size=4, causal_path="exact"), True)(q, k, v, None, None, stats)
    np.testing.assert_allclose(auto, np.asarray(exact, np.float64), rtol=1e-6, atol=1e-7)


# The causal scan carries its key sum from span to span (favor.attention.linear: spans of
# `causal_span` tokens, a whole number of chunks). The tests above run one span (L < 512: its step
# without the scan); these run several: causal_span=8 with chunks of 4, L = 21 (spans 8 + 8 + 5).
SPAN_KINDS = ("favor+", "favor", "favor#", "hrf")


@pytest.mark.parametrize("kind", SPAN_KINDS)
def test_causal_spans_equal_the_reference_with_padding(kind):
    """Whole spans of padding before the first key (the carry stays empty through them), a padded
    middle span, a padded last token, a row whose only keys are in the last span, a row with no key;
    each path; and queries fewer than keys starting mid-span."""
    l = 21
    q, k, v = qkv(b=5, lq=l, lk=l, seed=21)
    mask = np.ones((5, l), bool)
    mask[0, :16] = False
    mask[1, 8:16] = False
    mask[1, l - 1] = False
    mask[2, :19] = False
    mask[4] = False
    mask = jnp.asarray(mask)
    for path in ("auto", "fast", "exact"):
        attn = make(kind, chunk_size=4, causal_span=8, causal_path=path)
        stats = calibration_stats(attn, 8)
        out = check_against_reference(attn, q, k, v, mask, True, stats=stats)
        np.testing.assert_array_equal(out[4], 0.0)
        tail, _ = call(attn, True)(q[:, 11:], k, v, mask, None, stats)
        np.testing.assert_allclose(np.asarray(tail), out[:, 11:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", SPAN_KINDS)
def test_causal_spans_at_large_norms_equal_the_reference(kind):
    """Norms 1 … 10·√D along the sequence and reversed: later spans' keys far above the carried
    reference (auto takes the exact path for those spans only) or far below it."""
    d, l = 16, 21
    norms = np.linspace(1.0, 10.0 * d ** 0.5, l)
    attn = make(kind, chunk_size=4, causal_span=8)
    stats = calibration_stats(attn, d)
    for order in (norms, norms[::-1]):
        q, k, v = qkv(b=1, lq=l, lk=l, d=d, norms=order, seed=9)
        mask = jnp.ones((1, l), bool).at[0, 9].set(False)
        out = check_against_reference(attn, q, k, v, mask, True, stats=stats)
        np.testing.assert_allclose(out[:, 0], np.asarray(v[:, 0], np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ("favor+", "favor"))
def test_causal_span_gradients_equal_those_of_the_explicit_form(kind):
    """L = 9 in spans of 4 (chunks of 2): the carry's gradient, plain and with a window."""
    for path in ("auto", "fast"):
        check_gradients_against_explicit(kind, True, chunk_size=2, causal_span=4, causal_path=path)
    check_gradients_against_explicit(kind, True, window=2, chunk_size=2, causal_span=4)


def test_causal_span_option_is_checked():
    for bad in (0, -4, 2.5, True, "8"):
        with pytest.raises(ValueError, match="causal_span must be a positive integer"):
            make("favor+", causal_span=bad)


# -- invariants -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", LINEAR)
def test_causal_position_zero_outputs_v0_at_large_norms(kind):
    attn = make(kind, chunk_size=4)
    d, l = 16, 12
    q, k, v = qkv(b=1, lq=l, lk=l, d=d, norms=np.linspace(1.0, 10.0 * d ** 0.5, l), seed=2)
    for kk in (k, k[:, ::-1]):                      # later keys large, or the first one
        out, _ = call(attn, True)(q, kk, v, None, None, calibration_stats(attn, d))
        np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(v[:, 0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", FORMS)
def test_identical_keys_give_the_mean_of_valid_values(kind, causal):
    attn = make(kind, chunk_size=4)
    d, l = 16, 12              # the large-norm tests' shapes: their feature maps are compiled already
    q, k, v = qkv(b=1, lq=l, lk=l, d=d, norms=np.full(l, 8.0 * d ** 0.5), seed=4)
    k = jnp.broadcast_to(k[:, :1], k.shape)
    mask = jnp.ones((1, l), bool).at[0, 3].set(False)
    stats = calibration_stats(attn, d)
    out, ctx = call(attn, causal)(q, k, v, mask, None, stats)
    vv = np.where(np.asarray(mask)[..., None, None], np.asarray(v), 0.0)
    if causal:
        expect = np.cumsum(vv, 1) / np.cumsum(np.asarray(mask), 1)[..., None, None]
    else:
        expect = np.broadcast_to(vv.sum(1, keepdims=True) / np.asarray(mask).sum(), vv.shape)
    assert_close(attn, out, expect, q, k, v, mask, causal, stats, ctx=ctx)


@pytest.mark.parametrize("kind", FORMS)
def test_all_padding_row_outputs_zero_with_finite_gradients(kind):
    q, k, v = qkv(scale=3.0)
    mask = jnp.asarray(np.array([[True] * 9, [False] * 9]))
    for causal in (False, True):
        attn, program = grads_program(kind, causal, chunk_size=4)
        stats = calibration_stats(attn, 8) if causal else None
        out, grads = program(q, k, v, mask, jax.random.PRNGKey(0), stats, 0.0, 1.0)
        np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
        assert all(np.all(np.isfinite(np.asarray(g))) for g in grads), (kind, causal)


@pytest.mark.parametrize("kind", FORMS)
def test_length_one(kind):
    attn = make(kind)
    q, k, v = qkv(lq=1, lk=1, scale=5.0)
    q = jnp.abs(q)       # some positive coordinate, so ReLU's features are not all zero (0/0 gives 0)
    for causal in (False, True):
        stats = calibration_stats(attn, 8) if causal else None
        out, ctx = call(attn, causal)(q, k, v, None, None, stats)
        assert_close(attn, out, v, q, k, v, None, causal, stats, ctx=ctx)


# -- properties: the future and the padding never move anything ------------------------------------
def _perturb(x, start, seed, scale):
    noise = scale * jax.random.normal(jax.random.PRNGKey(seed), x.shape, jnp.float32)
    return x.at[:, start:].set(noise[:, start:].astype(x.dtype))


# (t, seed, scale of the new tokens): the first token alone, mid-chunk, and a chunk boundary of the fast
# path's chunks of 4 (the exact path takes L = 9 as one block)
FUTURE_CASES = ((1, 0, 1.0), (6, 1, 12.0), (8, 2, 12.0))


@pytest.mark.parametrize("kind", LINEAR_FORMS)
def test_causal_outputs_never_depend_on_the_future(kind):
    """Changing every token ≥ t (queries, keys, values; up to norms far beyond the rest) leaves the
    outputs and the gradients at positions < t bit for bit unchanged, on each causal path alone (the
    stabilisers are causal; "auto" chooses between the two on the whole input, so it is covered by the
    reference tests), and for the kinds whose features have no exponential (ReLU, ELU, the learned maps)
    on "auto" too, which is their plain pass while the features stay in range (causal_lib.causal_plain;
    chunks of 4 put t = 6 inside the second). No mask: a causal language model's call, whose code paths
    differ from the masked ones. float32 only: every linear kind casts its inputs to float32 first, so bf16
    inputs add only elementwise casts, which cannot carry a token into another's output."""
    q, k, v = qkv()
    rng = jax.random.PRNGKey(0)
    plain = () if attention.get(kind).finite_features else ("auto",)
    for path in ("fast", "exact", *plain):
        attn, program = grads_program(kind, True, chunk_size=4, causal_path=path)
        stats = calibration_stats(attn, 8)
        for t, seed, scale in FUTURE_CASES:
            weights = (jnp.arange(9) < t)[None, :, None, None].astype(jnp.float32)   # the loss sees the past
            q2, k2, v2 = (_perturb(a, t, seed + i, scale) for i, a in enumerate((q, k, v)))
            o1, g1 = program(q, k, v, None, rng, stats, 0.0, weights)
            o2, g2 = program(q2, k2, v2, None, rng, stats, 0.0, weights)
            assert np.all(np.isfinite(np.asarray(o1))) and np.all(np.isfinite(np.asarray(o2))), (path, t)
            np.testing.assert_array_equal(np.asarray(o1[:, :t]), np.asarray(o2[:, :t]), err_msg=f"{path} t={t}")
            for a, b in zip(g1, g2):
                np.testing.assert_array_equal(np.asarray(a[:, :t], np.float32), np.asarray(b[:, :t], np.float32),
                                              err_msg=f"{path} t={t}")


# bf16 for softmax alone: every linear kind casts queries, keys and values to float32 before anything
# else (`inputs`/`scaled`, linear.ones_column), so its padding logic sees float32 whatever the input dtype;
# softmax computes in the input's dtype. bf16 with padding is checked against the float64 reference for
# every linear kind by test_large_norms_equal_float64_reference.
@pytest.mark.parametrize("kind,causal,dtype", [(k, c, jnp.float32) for k in FORMS for c in (False, True)]
                         + [("softmax", False, jnp.bfloat16)])
def test_padded_keys_change_neither_outputs_nor_gradients(kind, dtype, causal):
    """Padded keys set to anything (norms up to 32·√D, values ±1e3) change no valid output and no
    gradient, and receive zero gradient themselves."""
    attn, program = grads_program(kind, causal, chunk_size=4)
    stats = calibration_stats(attn, 8) if causal else None
    q, k, v = qkv(seed=5, dtype=dtype)
    mask, rng = key_mask(), jax.random.PRNGKey(4)
    valid = np.asarray(mask)[:, :, None, None]
    o1, g1 = program(q, k, v, mask, rng, stats, 0.0, jnp.asarray(valid, jnp.float32))
    for seed, scale in ((1, 1.0), (2, 32.0)):
        k2 = jnp.where(~valid, _perturb(k, 0, seed, scale), k).astype(dtype)
        v2 = jnp.where(~valid, _perturb(v, 0, seed + 1, 1e3), v).astype(dtype)
        o2, g2 = program(q, k2, v2, mask, rng, stats, 0.0, jnp.asarray(valid, jnp.float32))
        np.testing.assert_allclose(np.where(valid, np.asarray(o1), 0), np.where(valid, np.asarray(o2), 0),
                                   rtol=1e-5, atol=1e-6)
        for a, b in zip(g1, g2):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), kind
            np.testing.assert_allclose(np.where(valid, a, 0), np.where(valid, b, 0), rtol=1e-4, atol=1e-5)
        for g in (g1[1], g1[2], g2[1], g2[2]):             # padded keys and values get no gradient
            np.testing.assert_array_equal(np.where(valid, 0, np.asarray(g, np.float32)), 0.0)


# -- decoding -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", LINEAR)
def test_decoding_step_equals_causal_pass(kind):
    attn = make(kind, chunk_size=4)
    d, l = 8, 9                # the reference tests' shapes (two full chunks and a partial one)
    q, k, v = qkv(lq=l, lk=l, d=d, scale=1.5)
    valid = jnp.ones((2, l), bool).at[1, 3].set(False)
    stats = calibration_stats(attn, d)
    full, full_ctx = call(attn, True)(q, k, v, valid, None, stats)
    ctx = attn.decode_context(d, stats=stats) if isinstance(attn, attention.RandomFeatureAttention) else None
    state = attn.decode_init(2, 2, d, v.shape[-1])
    step = jax.jit(attn.decode_step)                    # as a generation loop runs it: one program a step
    outs, states = [], [state]
    for t in range(l):
        o, state = step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], ctx, valid=valid[:, t])
        outs.append(o)
        states.append(state)
    assert_close(attn, jnp.concatenate(outs, 1), full, q, k, v, valid, True, stats, ctx=full_ctx)
    check_prefill(attn, states, q, k, v, ctx, valid, step, jnp.concatenate(outs, 1))


def check_prefill(attn, states, q, k, v, ctx, valid, step, outs):
    """A prompt's prefill (all its keys at once) leaves the state the loop had after as many tokens, at
    every prompt length (an empty one and one that ends on a padded token included), and decoding on
    from it gives the loop's outputs."""
    # the prefills of every prompt length in one program (a program per length was most of this test's time)
    prefills = jax.jit(lambda k, v, ctx, valid: [attn.decode_prefill(k[:, :p], v[:, :p], ctx, valid[:, :p])
                                                 for p in range(q.shape[1] + 1)])(k, v, ctx, valid)
    for p in range(q.shape[1] + 1):
        state = prefills[p]
        assert jax.tree.structure(state) == jax.tree.structure(states[p])
        for name in state:
            np.testing.assert_allclose(np.asarray(state[name]), np.asarray(states[p][name]), rtol=2e-5, atol=1e-6,
                                       err_msg=f"{attn.name} {name} after {p} tokens")
    # the two orders of summation round differently; for sign-indefinite kinds that rounding is amplified by
    # the ratio's condition (reference.attention), so their outputs may differ by a few float32 units of it
    atol = np.full(outs.shape[:3] + (1,), 1e-6)
    if not getattr(attn, "positive", True):
        _, cond = reference.attention(attn, q, k, v, ctx, valid, True, window=getattr(attn, "window", 0))
        atol = atol + 4 * np.finfo(np.float32).eps * cond[..., None]
    state = prefills[5]
    for t in range(5, q.shape[1]):
        o, state = step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], ctx, valid=valid[:, t])
        o, want = np.asarray(o, np.float64), np.asarray(outs[:, t:t + 1], np.float64)
        bad = np.abs(o - want) > 2e-5 * np.abs(want) + atol[:, t:t + 1]
        assert not bad.any(), (attn.name, t, np.argwhere(bad)[:3], o[bad], want[bad])


@pytest.mark.parametrize("kind", LINEAR)
def test_causal_with_fewer_queries_aligns_them_to_the_last_keys(kind):
    attn = make(kind, chunk_size=4)
    q, k, v = qkv()            # L = 9, the reference tests' shapes; the last 4 queries start mid-chunk
    stats = calibration_stats(attn, 8)
    full, _ = call(attn, True)(q, k, v, None, None, stats)
    tail, _ = call(attn, True)(q[:, 5:], k, v, None, None, stats)
    np.testing.assert_allclose(np.asarray(tail), np.asarray(full[:, 5:]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs Lq ≤ Lk"):
        attn(q, k[:, :4], v[:, :4], causal=True, stats=stats)


# -- data-dependent fits ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", DATA_DEPENDENT)
def test_causal_data_dependent_kinds_need_statistics(kind):
    attn = make(kind)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="in causal mode a fit on the sequence would read the future"):
        attn(q, k, v, causal=True)


def test_query_mask_is_explicit_in_cross_attention():
    """Lq == Lk cross-attention: the key mask masks keys only; the fit uses query_mask for queries."""
    attn = make("favor++", redraw="fixed")
    q, k, v = qkv(b=1, lq=8, lk=8)
    kmask = jnp.asarray([[True] * 5 + [False] * 3])
    qmask = jnp.asarray([[True] * 8])
    ctx = attn.context(q, k, kmask, query_mask=qmask)
    x, y = attn.scaled(q, k)
    sub = attn.mech.fit(x, y[:, :, :5])        # every query, the valid keys
    np.testing.assert_allclose(np.asarray(ctx.params.a), np.asarray(sub.a), rtol=1e-5)
    qmask2 = jnp.asarray([[True] * 3 + [False] * 5])
    ctx2 = attn.context(q, k, kmask, query_mask=qmask2)
    np.testing.assert_allclose(np.asarray(ctx2.params.a), np.asarray(attn.mech.fit(x[:, :, :3], y[:, :, :5]).a), rtol=1e-5)


@pytest.mark.parametrize("kind", ["favor+", "favor#"])
def test_importance_sampling_fit_gradients_are_finite_with_fewer_tokens_than_dims(kind):
    attn = make(kind, importance_sampling=True, fit_gradients=True, redraw="fixed")
    q, k, v = qkv(b=1, lq=3, lk=3, d=8)          # 3 tokens, 8 dims: degenerate spectra
    grads = jax.jit(jax.grad(lambda q, k: jnp.sum(attn(q, k, v) ** 2), (0, 1)))(q, k)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


# -- gradients, numerics ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_finite_differences(kind):
    opts = {"redraw": "fixed"}
    if kind in RF_KINDS:
        opts["fit_gradients"] = True   # finite differences see the fit move, so the gradient must too
    attn = make(kind, **(opts if kind in RF_KINDS else {}))
    q, k, v = qkv(b=1, lq=5, lk=5, h=1, d=4, dv=2, seed=7)
    mask = jnp.asarray([[True, True, True, True, False]])

    f = jax.jit(lambda q, k, v: attn(q, k, v, mask=mask, rng=None))

    # check_grads projects the whole reverse-mode gradient (padded key included) on random directions: a
    # non-finite entry anywhere fails it. HRF's is checked in v alone, so its q and k gradients here.
    if kind == "hrf":
        out = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)))(q, k, v)
        assert all(np.all(np.isfinite(np.asarray(g))) for g in out)
        # sign features are piecewise constant; finite differences across a flip are meaningless
        check_grads(lambda v: f(q, k, v), (v,), order=1, modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)
    else:
        check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-3, atol=3e-2, rtol=3e-2)


# the exact causal path is shared by every kind: three cover it
@pytest.mark.parametrize("kind,mode", [(k, m) for k in LINEAR for m in ("bidirectional", "causal")]
                         + [(k, "causal-exact") for k in ("favor+", "favor", "favor#")])
def test_gradients_equal_those_of_the_explicit_form(kind, mode):
    """Gradients to q, k and v equal the float64 autodiff of the explicit L×L form over the layer's own
    features (reference.explicit_attention: no stabiliser, chunk, scan or guard), with padding, L = 9 in
    chunks of 4. ("causal" runs "auto": the fast path on these inputs, the exact one for relu/elu.)
    This once failed: the causal prefix states' chunk maxima carried gradient the rescaling did not."""
    check_gradients_against_explicit(kind, mode != "bidirectional", chunk_size=4,
                                     **({"causal_path": "exact"} if mode == "causal-exact" else {}))


def check_gradients_against_explicit(kind, causal, window=0, **opts):
    """d/d(q, k, v) of a random projection of the output (L = 9, padding) against float64 autodiff of
    reference.explicit_attention (the same ω and fit; window > 0: the band exact)."""
    attn, program = grads_program(kind, causal, **opts, **({"window": window} if window else {}))
    q, k, v = qkv(seed=6)
    mask, rng = key_mask(), jax.random.PRNGKey(0)
    stats = calibration_stats(attn, 8) if causal else None
    weights = jax.random.normal(jax.random.PRNGKey(1), v.shape)
    _, got = program(q, k, v, mask, rng, stats, weights, 0.0)
    with jax.enable_x64(True):
        loss = lambda q, k, v: jnp.sum(reference.explicit_attention(attn, q, k, v, mask, causal, rng, stats,
                                                                    window=window) * weights)
        want = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-4,
                                   err_msg=f"{attn.name} causal={causal} window={window} d{name}")


@pytest.mark.parametrize("kind", ["favor", "hrf"])
def test_exact_zero_queries_and_keys_have_finite_gradients(kind):
    # sin(0) = 0 exactly: log|0| must not put an infinite derivative into the backward pass
    attn = attention.get(kind, num_features=8)
    q = jnp.zeros((1, 6, 2, 8)).at[:, :3].set(0.3)
    k = jnp.zeros((1, 6, 2, 8)).at[:, 2:].set(-0.2)
    v = jnp.ones((1, 6, 2, 8))
    grads = jax.jit(jax.grad(lambda q, k: jnp.sum(attn(q, k, v, rng=jax.random.PRNGKey(0)) ** 2), (0, 1)))(q, k)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("kind", FORMS)
def test_cross_attention_shapes(kind):
    attn = make(kind)
    q, k, v = qkv(lq=5, lk=9, dv=3)
    out, _ = call(attn, False)(q, k, v, key_mask(lk=9), jax.random.PRNGKey(0), None)
    assert out.shape == (2, 5, 2, 3) and np.all(np.isfinite(np.asarray(out)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["favor+", "favor++", "favor#", "simrf"])
def test_many_features_match_softmax(kind):
    """M = 4096 orthogonal/simplex features on small-norm inputs: close to exact attention."""
    attn = attention.get(kind, num_features=4096)
    q, k, v = qkv(b=1, lq=16, lk=16, h=2, d=16, scale=0.3)
    stats = attn.statistics(q, k) if attn.data_dependent else None   # the accuracy, not causality
    for causal in (False, True):
        out = jax.jit(lambda q, k, v: attn(q, k, v, causal=causal, rng=jax.random.PRNGKey(0),
                                           stats=stats if causal else None))(q, k, v)
        ref = attention.get("softmax")(q, k, v, causal=causal)
        err = float(jnp.max(jnp.abs(out - ref)))
        assert err < 0.05, (kind, causal, err)


# -- schedules, errors, jit, the NNX drop-in ---------------------------------------------------------
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
    with pytest.raises(ValueError, match=r"chunk_size must be a positive integer .*got 0"):
        attention.get("elu", chunk_size=0)
    with pytest.raises(ValueError, match="unknown causal_path 'quick'"):
        attention.get("elu", causal_path="quick")
    with pytest.raises(ValueError, match="unknown coupling 'qmc'"):
        attention.get("favor++", coupling="qmc")
    with pytest.raises(ValueError, match="simrf: unknown coupling 'orthogonal'; valid: 'simplex', 'simplex\\+'"):
        attention.get("simrf", coupling="orthogonal")
    q, k, v = qkv()
    with pytest.raises(ValueError, match="key-padding mask"):
        attention.get("favor+")(q, k, v, mask=jnp.ones((2, 9, 9), bool))
    with pytest.raises(ValueError, match="query_mask marks the real queries"):
        attention.get("favor+")(q, k, v, query_mask=jnp.ones((2, 8), bool))
    with pytest.raises(ValueError, match="q \\[B, Lq, H, D\\]"):
        attention.get("softmax")(q[0], k, v)


def test_simrf_is_simplex_coupled():
    attn = attention.get("simrf")
    assert attn.coupling == "simplex" and attention.get("simrf", coupling="simplex+").coupling == "simplex+"


def _mha(kind, **extra):
    from flax import nnx

    opts = {} if kind not in RF_KINDS else ({"num_features": 96, "num_lambda_features": 2} if kind == "hrf"
                                             else {"num_features": 16})
    return nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False,
                                  attention_fn=attention.attention_fn(kind, **opts, **extra), rngs=nnx.Rngs(0))


LEARNED = [k for k in KINDS if getattr(attention.get(k), "learned", False)]


def test_learned_kinds_have_no_dropin():
    """A learned map's weights are parameters; an attention_fn owns none, so asking for one is an error
    that names favor's layer. A width the map cannot have is an error naming what it can."""
    assert set(LEARNED) == {"hedgehog", "t2r"}
    for kind, bad, allowed in (("hedgehog", 5, "multiple of 2"), ("t2r", 0, "multiple of 1")):
        with pytest.raises(ValueError, match=f"{kind}: num_features must be a positive {allowed}; got {bad}"):
            attention.get(kind, num_features=bad)
    for kind in LEARNED:
        with pytest.raises(ValueError, match="learned feature map.*SelfAttention"):
            attention.attention_fn(kind)
    # the window's learned mix is a parameter too
    with pytest.raises(ValueError, match="window_mix='learned' trains a mixing weight per head"):
        attention.attention_fn("favor+", window=4, window_mix="learned")


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in LEARNED])
def test_nnx_multihead_attention_dropin(kind):
    """nnx.MultiHeadAttention(attention_fn=...) with every kind (learned maps: the test above), padding
    mask, under jit and grad."""
    from flax import nnx

    mha = _mha(kind)
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
    forward = nnx.jit(lambda m, x: m(x, mask=mask, deterministic=True))
    out, out2 = forward(mha, x), forward(mha, x2)
    np.testing.assert_allclose(np.asarray(out[1, :4]), np.asarray(out2[1, :4]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["favor+", "elu", "favor++"])
def test_nnx_dropin_recognises_a_causal_mask_and_refuses_other_patterns(kind):
    from flax import nnx

    stats = None
    if kind == "favor++":
        stats = calibration_stats(make(kind), 4)      # causal data-dependent: statistics from outside
    mha = _mha(kind, stats=stats)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 8))
    valid = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], bool)
    causal_mask = nnx.combine_masks(nnx.make_attention_mask(valid, valid), nnx.make_causal_mask(valid))
    by_mask = mha(x, mask=causal_mask, deterministic=True)
    # the same as running the kind causally on the projected inputs: the future does not move the past
    x2 = x.at[:, 4:].set(5.0)
    out2 = mha(x2, mask=causal_mask, deterministic=True)
    np.testing.assert_allclose(np.asarray(by_mask[:, :4]), np.asarray(out2[:, :4]), rtol=1e-5, atol=1e-6)
    jitted = nnx.jit(lambda m, x, mask: m(x, mask=mask, deterministic=True))
    np.testing.assert_allclose(np.asarray(jitted(mha, x, causal_mask)), np.asarray(by_mask), rtol=1e-5, atol=1e-6)
    block = np.zeros((2, 1, 6, 6), bool)
    block[:, :, :3, :3] = block[:, :, 3:, 3:] = True
    with pytest.raises(ValueError, match="neither a padding mask nor a causal one"):
        mha(x, mask=jnp.asarray(block), deterministic=True)
    with pytest.raises(Exception, match="neither a padding mask nor a causal one"):
        jax.block_until_ready(jitted(mha, x, jnp.asarray(block)))


# -- model layer: running statistics for causal data-dependent kinds ----------------------------------
def test_causal_self_attention_keeps_running_statistics():
    from flax import nnx

    from favor.models.layers import SelfAttention

    layer = SelfAttention(16, 2, {"kind": "favor++", "num_features": 16}, causal=True, rngs=nnx.Rngs(0))
    assert layer.fit_stats is not None and float(layer.fit_stats.get_value().count[0]) == 0
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 12, 16))
    before = layer(x, deterministic=True)
    assert float(layer.fit_stats.get_value().count[0]) == 0        # evaluation never updates them
    layer(x, deterministic=False)
    s = layer.fit_stats.get_value()
    assert float(s.count[0]) == 24
    # the first update takes the batch's statistics: the pooled per-head moments of the scaled keys
    k = layer.key(x).reshape(2, 12, 2, 8) * 8 ** -0.25
    np.testing.assert_allclose(np.asarray(s.mean_y), np.asarray(jnp.mean(k, axis=(0, 1))), rtol=1e-5, atol=1e-6)
    after = layer(x, deterministic=True)
    assert not np.allclose(np.asarray(before), np.asarray(after))    # the fit now uses them
    # and the layer is causal whatever the statistics
    x2 = x.at[:, 6:].set(3.0)
    np.testing.assert_allclose(np.asarray(layer(x2, deterministic=True)[:, :6]), np.asarray(after[:, :6]),
                               rtol=1e-5, atol=1e-6)


# -- regressions from the independent review ---------------------------------------------------------
@pytest.mark.parametrize("variant", ["sderf", "aderf"])
def test_fit_gradients_finite_with_an_all_padding_example(variant):
    """A zero spectrum (an example with no valid token) once gave 0/0 in the eigh derivative."""
    attn = make("favor#", variant=variant, fit_gradients=True)
    q, k, v = qkv(b=2, lq=5, lk=5, d=8, scale=0.5)
    m = jnp.asarray([[True] * 5, [False] * 5])
    g = jax.jit(jax.grad(lambda q: jnp.sum(attn(q, k, v, mask=m, query_mask=m))))(q)
    assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("kind", ["relu", "elu"])
def test_causal_elementwise_kinds_with_tiny_features(kind):
    """Key features of 1e-19 and a query whose strongest feature no key carries: every product is far
    below float32's normal range, yet the ratio is well defined (the fast path would lose every term)."""
    l = 6
    q = jnp.zeros((1, l, 1, 2)).at[..., 0].set(1.0).at[..., 1].set(1e-19)
    k = jnp.zeros((1, l, 1, 2)).at[..., 0].set(-1.0).at[..., 1].set(1e-19)
    if kind == "elu":
        q, k = q.at[..., 1].set(-100.0 + 1e-5 * jnp.arange(l)[None, :, None]), k.at[..., 1].set(-95.0)
    v = jnp.arange(l, dtype=jnp.float32).reshape(1, l, 1, 1)
    out = make(kind, chunk_size=2)(q, k, v, causal=True)
    ref, _ = reference.attention(make(kind), q, k, v, None, None, True)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)
    # the plain pass runs beside the exact one and its result is dropped: its gradient must not poison
    # the exact path's (0·inf), so "auto" has the exact path's gradients here
    w = jnp.linspace(-1.0, 1.0, l).reshape(1, l, 1, 1)
    # (and features of 1e25, whose products overflow float32 on the plain pass)
    grad = {path: jax.jit(jax.grad(lambda q, k, v, attn=make(kind, chunk_size=2, causal_path=path): jnp.sum(
        w * attn(q, k, v, causal=True)), (0, 1, 2))) for path in ("auto", "exact")}
    for q, k in ((q, k), (q * 1e25 + 1e25, k * 1e25 + 1e25)):
        grads = {path: g(q, k, v) for path, g in grad.items()}
        largest = max(float(np.abs(np.asarray(b)).max()) for b in grads["exact"])
        for a, b in zip(grads["auto"], grads["exact"]):
            assert np.all(np.isfinite(np.asarray(a)))
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * largest)


@pytest.mark.parametrize("kind,phi", [("relu", lambda u: np.maximum(u, 0.0)),
                                      ("elu", lambda u: np.where(u > 0, u + 1.0, np.exp(np.minimum(u, 0.0))))])
def test_plain_causal_path_of_elementwise_kinds(kind, phi):
    """causal_lib.causal_plain (ReLU/ELU's "auto" where their features allow) against a float64 L×L form
    written here: padding (a row with no key), Lq < Lk, chunks that do not divide L, norms up to 10·√D;
    and the range check that picks it: normal features pass, features whose products underflow do not."""
    rng = np.random.default_rng(7)
    attn = make(kind)

    def plain(q, k, v, mask, c):      # under jit: one program per case (eagerly, one per operation)
        fq, fk = attn.phi(q), attn.phi(k)
        return causal_lib.plain_features_safe(fq, fk, mask), causal_lib.causal_plain(fq, fk, v, mask, True, c)
    plain = jax.jit(plain, static_argnums=4)
    for lq, lk, c, scale in ((1, 1, 4, 1.0), (9, 9, 4, 1.0), (7, 12, 4, 10.0), (33, 33, 8, 10.0)):
        q, k = (rng.normal(size=(2, n, 2, 8)) * scale for n in (lq, lk))
        v = rng.normal(size=(2, lk, 2, 3))
        mask = rng.random((2, lk)) > 0.3
        mask[1] = False
        to_bhld = lambda a: jnp.asarray(np.moveaxis(a, 1, 2), jnp.float32)
        safe, out = plain(to_bhld(q), to_bhld(k), to_bhld(v), jnp.asarray(mask), c)
        assert bool(safe)
        out = np.moveaxis(np.asarray(out, np.float64), 1, 2)
        w = np.einsum("bihf,bjhf->bhij", phi(q), phi(k))
        seen = (np.arange(lq)[:, None] + lk - lq >= np.arange(lk)[None]) & mask[:, None, None, :]
        w = np.where(seen, w, 0.0)
        den = w.sum(-1)
        ref = np.einsum("bhij,bjhd->bihd", w, v) / np.where(den > 0, den, 1.0).transpose(0, 2, 1)[..., None]
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6 * np.abs(ref).max(), err_msg=f"{lq} {lk} {c}")
        assert np.all(out[1] == 0)                                        # no valid key: 0
    tiny = jnp.full((1, 1, 4, 2), 1e-19)
    assert not bool(causal_lib.plain_features_safe(tiny, tiny))
    assert bool(causal_lib.plain_features_safe(jnp.ones_like(tiny), tiny, jnp.zeros((1, 4), bool)))   # keys padded


def test_elu_features_keep_their_relative_precision_far_below_zero():
    """φ(u) = elu(u) + 1 is exp(u) below 0, to float32's relative precision (expm1(u) + 1 would round
    features below e^-17 to multiples of 2^-24: a 1e-3 error in the outputs of queries near −20); and
    its gradient is finite where the exponential of the other branch would overflow."""
    u = np.linspace(-40.0, 5.0, 451).astype(np.float32).astype(np.float64)     # the inputs float32 holds
    phi = np.asarray(make("elu").phi(jnp.asarray(u, jnp.float32)), np.float64)
    ref = np.where(u > 0, u + 1.0, np.exp(np.minimum(u, 0.0)))
    np.testing.assert_allclose(phi, ref, rtol=1e-6)
    grad = jax.vmap(jax.grad(make("elu").phi))(jnp.asarray([-50.0, -1.0, 0.5, 200.0]))
    np.testing.assert_allclose(np.asarray(grad), [np.exp(-50.0), np.exp(-1.0), 1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("kind", RF_KINDS)
def test_a_fixed_draw_is_made_once_and_is_the_seeds_draw(kind):
    """redraw='fixed' (and evaluation, rng None) uses the seed's draw: the same outputs as drawing from
    that key in the call (redraw='step' with rng = the seed's key), but inside a jitted function the draw
    is a constant of the program, not random bits and an orthogonal QR computed in every call."""
    q, k, v = qkv(lq=11, lk=11)
    fixed = make(kind, redraw="fixed", seed=3)
    per_call = make(kind, redraw="step")(q, k, v, rng=jax.random.PRNGKey(3))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda q, k, v: fixed(q, k, v))(q, k, v)),
                               np.asarray(per_call), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(fixed(q, k, v)), np.asarray(per_call), rtol=1e-5, atol=1e-6)
    for cached in jax.tree.leaves(fixed._fixed_draws):
        assert not isinstance(cached, jax.core.Tracer)
    drawing = {"random_bits", "threefry2x32", "random_wrap", "qr", "geqrf", "householder_product"}
    primitives = lambda f, *a: set(re.findall(r"= ([a-z_0-9]+)\b", str(jax.make_jaxpr(f)(*a))))
    assert not primitives(lambda q, k, v: fixed(q, k, v), q, k, v) & drawing
    step = make(kind, redraw="step")
    assert primitives(lambda q, k, v, r: step(q, k, v, rng=r), q, k, v, jax.random.PRNGKey(0)) & drawing


def test_a_single_chunk_takes_the_whole_array_program():
    """Keys and queries within one chunk: no scan, no rematerialisation in the program, and the same
    outputs and gradients as the chunked pass."""
    q, k, v = qkv(lq=24, lk=24)
    whole, chunked = make("favor+", chunk_size=32, redraw="fixed"), make("favor+", chunk_size=8, redraw="fixed")
    loss = lambda attn: lambda q, k, v: jnp.sum(attn(q, k, v) ** 2)
    program = str(jax.make_jaxpr(loss(whole))(q, k, v))
    assert "scan" not in program and "remat" not in program and "checkpoint" not in program
    assert "scan" in str(jax.make_jaxpr(loss(chunked))(q, k, v))
    np.testing.assert_allclose(whole(q, k, v), chunked(q, k, v), rtol=1e-5, atol=1e-6)
    grads = lambda attn: jax.jit(jax.grad(loss(attn), (0, 1, 2)))(q, k, v)
    for a, b in zip(grads(whole), grads(chunked)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["favor+", "favor"])
def test_a_single_causal_span_takes_no_scan(kind):
    """A causal sequence within one span: the fast path's program has no scan and no rematerialisation,
    and gives the outputs and gradients of the same sequence run as several spans (the carried sums)."""
    q, k, v = qkv(lq=12, lk=12, seed=3)
    mask = key_mask(lk=12)
    one, spans = (make(kind, chunk_size=4, causal_span=s, causal_path="fast", redraw="fixed") for s in (16, 4))
    loss = lambda attn: lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v, mask=mask, causal=True)))
    program = str(jax.make_jaxpr(jax.grad(loss(one), (0, 1, 2)))(q, k, v))
    assert "scan" not in program and "remat" not in program and "checkpoint" not in program
    assert "scan" in str(jax.make_jaxpr(loss(spans))(q, k, v))
    run = lambda attn: jax.jit(jax.value_and_grad(loss(attn), (0, 1, 2)))(q, k, v)
    (a, ga), (b, gb) = run(one), run(spans)
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_the_passes_inline_into_a_traced_caller_and_compile_when_eager(causal, monkeypatch):
    """Inside a caller's trace the passes are plain code (no nested jit, which XLA:CPU fuses apart from
    its caller); an eager call runs them compiled; both give the same attention."""
    q, k, v = qkv(b=1, lq=23, lk=23, h=3, dv=7)
    attn = make("favor+", redraw="fixed")
    program = jax.make_jaxpr(lambda q, k, v: attn(q, k, v, causal=causal))(q, k, v)
    names = {str(e.params.get("name")) for e in program.jaxpr.eqns if e.primitive.name in ("pjit", "jit")}
    assert not names & {"bidirectional_maps", "causal_maps"}, names
    wrapper = causal_lib.causal_maps if causal else bidirectional.bidirectional_maps
    calls = []
    spy = lambda *a, jitted=wrapper.jitted, **kw: calls.append(1) or jitted(*a, **kw)
    monkeypatch.setattr(wrapper, "jitted", spy)
    jax.jit(lambda q, k, v: attn(q, k, v, causal=causal))(q, k, v)
    assert calls == []                                   # traced: plain code, not the jitted pass
    eager = attn(q, k, v, causal=causal)
    assert calls == [1]                                  # eager: the jitted pass
    np.testing.assert_allclose(jax.jit(lambda q, k, v: attn(q, k, v, causal=causal))(q, k, v), eager,
                               rtol=1e-6, atol=1e-7)


def test_the_default_chunking_takes_whole_arrays_while_the_features_are_small():
    """chunk_size left to the pass: whole arrays (no scan) while a [B, H, L, F] feature array holds at most
    bidirectional.WHOLE_ARRAY_ELEMENTS elements, chunks above (traced only: shapes, no computation)."""
    attn = make("favor+", num_features=64, redraw="fixed")
    f = lambda q, k, v: attn(q, k, v)

    def program(batch, length):
        a = jax.ShapeDtypeStruct((batch, length, 2, 8), jnp.float32)
        return str(jax.make_jaxpr(f)(a, a, a))
    rows = bidirectional.WHOLE_ARRAY_ELEMENTS // 64          # B·H·L at the bound
    assert "scan" not in program(1, rows // 2)        # H = 2: exactly at the bound, one sequence longer than a chunk
    assert "scan" in program(1, rows // 2 + bidirectional.BIDIRECTIONAL_CHUNK)
    assert "scan" in program(4, rows // 4)            # the batch counts too
    # the per-row forms (trig, HRF) keep chunks beyond one chunk even when small
    trig = make("favor", num_features=64, redraw="fixed")
    a = jax.ShapeDtypeStruct((1, 2 * bidirectional.BIDIRECTIONAL_CHUNK, 2, 8), jnp.float32)
    assert "scan" in str(jax.make_jaxpr(lambda q, k, v: trig(q, k, v))(a, a, a))


@pytest.mark.parametrize("kind", ["favor+", "favor", "hrf", "favor++"])
def test_parameters_of_the_dimension_alone_have_no_batch_dims(kind):
    """A data-independent mechanism's parameters are one set for every batch and head (its projection is
    one matrix, not a copy per head); a fitted one's are per batch and head. Outputs as before: the
    float64 comparisons elsewhere cover them."""
    q, k, v = qkv()
    attn = make(kind)
    leading = {a.shape[:-1] if a.ndim else () for a in jax.tree.leaves(attn.context(q, k).params)}
    if attn.data_dependent:
        assert all(shape[:2] == q.shape[:1] + q.shape[2:3] for shape in leading if len(shape) >= 2), leading
    else:
        assert all(len(shape) <= 1 for shape in leading), leading


def test_a_kind_spec_names_its_kind_variant_and_window():
    assert attention.parse_spec("favor#:saderf@16") == ("favor#", {"variant": "saderf", "window": 16})
    assert attention.parse_spec("hrf:cluster") == ("hrf", {"lambda_": "cluster"})
    assert attention.parse_spec("simrf:oprf") == ("simrf", {"features": "oprf"})
    assert attention.parse_spec("relu") == ("relu", {})
    assert attention.parse_spec("softmax@8") == ("softmax", {"window": 8})          # the band alone
    for spec, words in (("nope", ["unknown attention kind 'nope'", "favor+"]), ("relu:x", ["has no variant", "hrf"]),
                        ("hrf:bogus", ["'bogus'", "'angular'"]), ("favor+@x", ["window", "'x'"]),
                        ("elu@-2", ["window", "'-2'"])):
        with pytest.raises(ValueError) as e:
            attention.parse_spec(spec)
        assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("path", ["exact", "fast"])
def test_causal_padding_rows_carry_no_scale(path):
    """Log-features far below 0 at a length that leaves padding rows in the last chunk: the padding is no
    key (−inf), so it sets no chunk's scale, and the output is the float64 causal ratio, not an underflow."""
    rng = np.random.default_rng(3)
    b, h, l, f, dv = 1, 2, causal_lib.EXACT_BLOCK + 5, 6, 3
    lq = rng.normal(size=(b, h, l, f))
    lk = rng.normal(size=(b, h, l, f)) - 300.0
    v = rng.normal(size=(b, h, l, dv))
    given = lambda ctx, a: (a, None)
    out = causal_lib.causal_maps(given, given, None, jnp.asarray(lq, jnp.float32), jnp.asarray(lk, jnp.float32),
                             jnp.asarray(v, jnp.float32), chunk_size=causal_lib.EXACT_BLOCK, path=path)
    w = np.einsum("bhif,bhjf->bhij", np.exp(lq), np.exp(lk + 300.0)) * np.tril(np.ones((l, l)))
    want = np.einsum("bhij,bhjd->bhid", w, v) / w.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length", [1, 5, 64, 65, 200])
def test_cumulative_is_the_running_reduction_and_reads_no_future(length):
    """linear.cumulative (the prefix reductions of the causal passes and the causal floor) against numpy's
    running sum (float64), maximum, minimum and log-sum-exp, along the sequence axis of [B, H, L, X]; and
    with every later element replaced, the earlier results are unchanged bit for bit."""
    rng = np.random.default_rng(length)
    a = rng.normal(size=(2, 3, length, 4)).astype(np.float32) * 5
    cases = ((jnp.add, 0.0, np.cumsum(a.astype(np.float64), axis=2), 1e-5),
             (jnp.maximum, -np.inf, np.maximum.accumulate(a, axis=2), 0.0),
             (jnp.minimum, np.inf, np.minimum.accumulate(a, axis=2), 0.0),
             (jnp.logaddexp, -np.inf, np.logaddexp.accumulate(a.astype(np.float64), axis=2), 1e-6))
    run = jax.jit(linear.cumulative, static_argnums=(1, 2))     # one program per reduction, for a and b
    for op, fill, expect, tol in cases:
        got = np.asarray(run(jnp.asarray(a), op, fill))
        np.testing.assert_allclose(got, expect, rtol=tol, atol=tol * np.abs(a).sum(2, keepdims=True).max())
        cut = length // 2
        b = a.copy()
        b[:, :, cut:] = rng.normal(size=b[:, :, cut:].shape) * 1e6
        np.testing.assert_array_equal(np.asarray(run(jnp.asarray(b), op, fill))[:, :, :cut], got[:, :, :cut])
    flags = rng.random((2, 1, length)) < 0.1
    np.testing.assert_array_equal(np.asarray(run(jnp.asarray(flags), jnp.logical_or, False)),
                                  np.logical_or.accumulate(flags, axis=2))


@pytest.mark.parametrize("length", [1, 9, 64, 65])
def test_segmented_reductions_restart_at_each_run(length):
    """linear.segmented_all (the documents' running statistics, several arrays in one scan) against a numpy
    loop in float64: each position's sum, minimum, maximum and log-sum-exp over the positions ≤ it of its own
    run, for [B, H, L, X] and [B, H, L] arrays beside each other and runs [B, 1, L, 1] of uneven lengths."""
    rng = np.random.default_rng(length)
    runs = np.cumsum(rng.random((2, length)) < 0.3, axis=1).astype(np.int32)           # non-decreasing
    parts = {"sum": rng.normal(size=(2, 3, length, 4)), "low": rng.normal(size=(2, 3, length, 4)),
             "high": rng.normal(size=(2, 1, length, 1)), "mass": rng.normal(size=(2, 3, length)) * 5}
    ops = {"sum": (jnp.add, np.add), "low": (jnp.minimum, np.minimum), "high": (jnp.maximum, np.maximum),
           "mass": (jnp.logaddexp, np.logaddexp)}
    got = jax.jit(lambda p, r: linear.segmented_all(p, r, {k: o[0] for k, o in ops.items()}, axis=2))(
        {k: jnp.asarray(a, jnp.float32) for k, a in parts.items()}, jnp.asarray(runs)[:, None, :, None])
    for name, a in parts.items():
        want = a.copy()
        for i in range(1, length):
            same = (runs[:, i] == runs[:, i - 1]).reshape((2,) + (1,) * (a.ndim - 2))
            want[:, :, i] = np.where(same, ops[name][1](want[:, :, i - 1], a[:, :, i]), a[:, :, i])
        np.testing.assert_allclose(np.asarray(got[name], np.float64), np.broadcast_to(want, got[name].shape),
                                   rtol=1e-5, atol=1e-5 * np.abs(a).max() * 4, err_msg=name)


@pytest.mark.parametrize("length", [1, 7, 64, 65, 200])
def test_cumulative_sum_is_the_running_sum_and_reads_no_future(length):
    """linear.cumulative_sum against numpy's float64 running sum along axis 2 and along the last axis, and
    earlier results unchanged bit for bit when every later element is replaced."""
    rng = np.random.default_rng(length)
    a = rng.normal(size=(2, 3, length, 4)).astype(np.float32)
    run = jax.jit(linear.cumulative_sum, static_argnums=1)
    for axis in (2, -1):
        x = a if axis == 2 else np.swapaxes(a, 2, 3)
        got = np.asarray(run(jnp.asarray(x), axis))
        np.testing.assert_allclose(got, np.cumsum(x.astype(np.float64), axis=axis), rtol=1e-5,
                                   atol=1e-5 * np.sqrt(length))
    b = a.copy()
    b[:, :, length // 2:] *= 1e6
    cut = length // 2
    same = lambda z: np.asarray(run(jnp.asarray(z), 2))[:, :, :cut]     # both from one program
    np.testing.assert_array_equal(same(b), same(a))
