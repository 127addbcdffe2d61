"""The local-window hybrid (`window=w`): exact softmax weights on the band |i − j| ≤ w, the kind's
estimate elsewhere, one normaliser. Against the explicit L×L form in float64 (tests/reference.py: the
estimate's terms written again from the formulas, the band's exp(qᵀk/√D) in the test), against exact
softmax as w → L, and the invariants every kind keeps: padding, causality, decoding, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from favor import attention, job
from favor.config import loading
from favor.attention import window as window_lib
from test_attention import (calibration_stats, check_gradients_against_explicit, check_prefill, context_of, key_mask,
                            make, qkv)


def _traced(a):
    return all(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree.leaves(a))


def compiled(fn, *args, **kwargs):
    """fn(*args, **kwargs) as one compiled program; eager, each operation compiles on its own. Arrays and
    pytrees of them (None included) are traced; everything else (Python scalars, layers) stays static."""
    arrays = {i: a for i, a in enumerate(args) if _traced(a)}
    named = {n: a for n, a in kwargs.items() if _traced(a)}
    return jax.jit(lambda arrays, named: fn(*(arrays.get(i, a) for i, a in enumerate(args)),
                                            **{**kwargs, **named}))(arrays, named)


def check(attn, q, k, v, mask, causal, rng=None, stats=None, rtol=2e-4):
    out = compiled(attn, q, k, v, mask=mask, causal=causal, rng=rng, stats=stats)
    ctx = compiled(context_of, attn, q, k, mask, rng, causal, stats)
    ref, cond = reference.attention(attn, q, k, v, ctx, mask, causal, window=attn.window)
    out = np.asarray(out, np.float64)
    # bf16 outputs are rounded to bf16 (8 bits): that rounding is allowed on top
    out_rtol = 2.0 ** -8 if v.dtype == jnp.bfloat16 else 0.0
    bound = rtol * cond[..., None] + out_rtol * np.abs(ref) + 1e-30
    bad = np.abs(out - ref) > bound
    assert not bad.any(), (attn.name, causal, float(np.max(np.abs(out - ref) / bound)), np.argwhere(bad)[:3])
    return out, ref


# one kind per feature form: positive (favor+), data-dependent (favor#), signed per-row scale (favor),
# mixed blocks (hrf); favor++ and simrf share favor+'s form and the window code
FORMS = ["favor+", "favor#", "favor", "hrf"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", FORMS)
def test_equals_the_explicit_form_with_padding(kind, causal):
    """L = 9 with chunks of 4 and w = 2: the band crosses chunk boundaries, padded keys inside it."""
    attn = make(kind, chunk_size=4, window=2)
    q, k, v = qkv()
    check(attn, q, k, v, key_mask(), causal, rng=jax.random.PRNGKey(3),
          stats=calibration_stats(attn, 8) if causal else None)


@pytest.mark.parametrize("window", [1, 20])
@pytest.mark.parametrize("causal", [False, True])
def test_windows_narrower_and_wider_than_a_chunk(window, causal):
    """Band blocks of 16 queries against one neighbouring block (w = 1) or two each side (w = 20 > the
    block), L = 37: a partial last block."""
    attn = make("favor+", chunk_size=8, window=window)
    q, k, v = qkv(lq=37, lk=37, seed=2)
    mask = np.ones((2, 37), bool)
    mask[0, 30:] = False
    mask[1, [0, 17]] = False
    check(attn, q, k, v, jnp.asarray(mask), causal, rng=jax.random.PRNGKey(1))


@pytest.mark.parametrize("path", ["fast", "exact"])
@pytest.mark.parametrize("kind", ["favor+", "favor"])
def test_large_norms_and_both_causal_paths(kind, path):
    """Norms from 1 to 10·√D along the sequence, reversed (a large first key); each causal path."""
    d, l = 16, 12
    attn = make(kind, chunk_size=4, window=3, causal_path=path)
    norms = np.linspace(1.0, 10.0 * d ** 0.5, l)[::-1]
    q, k, v = qkv(b=1, lq=l, lk=l, d=d, norms=norms, seed=9)
    for causal in (False, True):
        if path == "fast" and kind == "favor" and not causal:
            continue            # the path is a causal option; bidirectional was covered by "exact"
        out, _ = check(attn, q, k, v, None, causal, rng=jax.random.PRNGKey(2))
        assert np.all(np.isfinite(out))


def test_bf16_inputs():
    attn = make("favor++", chunk_size=4, window=2)
    q, k, v = qkv(dtype=jnp.bfloat16)
    for causal in (False, True):
        check(attn, q, k, v, key_mask(), causal, rng=jax.random.PRNGKey(3),
              stats=calibration_stats(attn, 8) if causal else None)


@pytest.mark.parametrize("causal", [False, True])
def test_tends_to_exact_softmax_as_the_window_grows(causal):
    """The mean (over 8 draws) error against softmax falls as w grows, and w = L − 1 is softmax."""
    l = 16
    q, k, v = qkv(b=1, lq=l, lk=l, scale=1.0, seed=7)
    exact = np.asarray(compiled(attention.get("softmax"), q, k, v, causal=causal))
    errors, keys = {}, jax.random.split(jax.random.PRNGKey(0), 8)
    for w in (0, 3, 8, l - 1):
        attn = make("favor+", chunk_size=8, window=w)
        outs = jax.jit(jax.vmap(lambda key: attn(q, k, v, causal=causal, rng=key)))(keys)
        errors[w] = float(np.abs(np.asarray(outs) - exact[None]).mean())
    assert errors[0] > errors[3] > errors[8], errors
    assert errors[l - 1] < 1e-6, errors


@pytest.mark.parametrize("kind", ["favor+", "favor#", "hrf"])
def test_causal_invariants(kind):
    """Position 0 outputs v_0 (norms to 10·√D); a future token moves no past output. (Identical keys do
    not give the mean of the values here: on the band their weight is exact, off it estimated.)"""
    d, l = 16, 12
    attn = make(kind, chunk_size=4, window=3)
    stats = calibration_stats(attn, d)
    norms = np.full(l, 10.0 * d ** 0.5)
    q, k, v = qkv(b=1, lq=l, lk=l, d=d, norms=norms, seed=4)
    out = compiled(attn, q, k, v, causal=True, stats=stats)
    np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(v[:, 0]), rtol=1e-5, atol=1e-5)

    # each causal path alone is causal bit for bit ("auto" picks a path from the whole input, so a future
    # token may switch it and move the past at rounding level: favor.attention.causal)
    t = 6
    k2 = k.at[:, t + 1:].set(-3.0 * k[:, t + 1:])
    v2 = v.at[:, t + 1:].set(100.0)
    for path in ("fast", "exact"):
        attn = make(kind, chunk_size=4, window=3, causal_path=path)
        run = jax.jit(lambda q, k, v: attn(q, k, v, causal=True, stats=stats))
        a = np.asarray(run(q, k, v))
        b = np.asarray(run(q, k2, v2))
        np.testing.assert_array_equal(a[:, :t + 1], b[:, :t + 1], err_msg=path)


def test_a_window_wider_than_the_sequence_is_the_whole_sequence():
    """w ≫ L gives what w = L − 1 gives (exact softmax), with the band's blocks sized by L, not w."""
    q, k, v = qkv(lq=8, lk=8)
    for causal in (False, True):
        wide = compiled(make("favor+", window=4096), q, k, v, causal=causal)
        exact = compiled(attention.get("softmax"), q, k, v, causal=causal)
        np.testing.assert_allclose(np.asarray(wide), np.asarray(exact), rtol=1e-5, atol=1e-6)
    x = jnp.zeros((1, 1, 8, 4))
    lowered = jax.jit(lambda x: window_lib.band_sums(x, x, x, jnp.ones((1, 1, 8), bool), 4096, 4096)).lower(x)
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    small = jax.jit(lambda x: window_lib.band_sums(x, x, x, jnp.ones((1, 1, 8), bool), 7, 7)).lower(x)
    assert temp <= small.compile().memory_analysis().temp_size_in_bytes


def test_length_one_and_empty_rows():
    attn = make("favor+", window=4)
    q, k, v = qkv(lq=1, lk=1)
    for causal in (False, True):
        np.testing.assert_allclose(np.asarray(compiled(attn, q, k, v, causal=causal)), np.asarray(v), rtol=1e-6)
    q, k, v = qkv()
    mask = jnp.asarray(np.ones((2, 9), bool)).at[0].set(False)       # a row with no valid key
    for causal in (False, True):
        out = np.asarray(compiled(attn, q, k, v, mask=mask, causal=causal))
        np.testing.assert_array_equal(out[0], 0.0)
        assert np.all(np.isfinite(out))


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_change_neither_outputs_nor_gradients(causal):
    attn = make("favor++", chunk_size=4, window=2)
    stats = calibration_stats(attn, 8) if causal else None
    q, k, v = qkv(seed=5)
    mask = key_mask()
    valid = np.asarray(mask)[:, :, None, None]

    @jax.jit
    def grads(q, k, v):
        def loss(q, k, v):
            out = attn(q, k, v, mask=mask, causal=causal, rng=jax.random.PRNGKey(4), stats=stats)
            return jnp.sum(jnp.where(valid, out, 0.0) ** 2)
        return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

    l1, g1 = grads(q, k, v)
    l2, g2 = grads(q, jnp.where(valid, k, 30.0), jnp.where(valid, v, 1e3))
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    for a, b in zip(g1, g2):
        assert np.all(np.isfinite(np.asarray(a))) and np.all(np.isfinite(np.asarray(b)))
        np.testing.assert_allclose(np.where(valid, a, 0), np.where(valid, b, 0), rtol=1e-4, atol=1e-5)
    for g in (g1[1], g1[2], g2[1], g2[2]):
        np.testing.assert_array_equal(np.where(valid, 0, np.asarray(g)), 0.0)


@pytest.mark.parametrize("kind", ["favor+", "favor"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_those_of_the_explicit_form(kind, causal):
    """Gradients to q, k, v equal the autodiff of the explicit L×L form in float64
    (reference.explicit_attention: the band's exp(qᵀk/√D), φ_qᵀφ_k elsewhere, same ω), with padding."""
    check_gradients_against_explicit(kind, causal, window=2, chunk_size=4)


@pytest.mark.parametrize("kind", FORMS)
def test_decoding_step_equals_causal_pass(kind):
    """Token by token (the band's keys kept exactly, the leaving key absorbed) equals the causal pass;
    a padded token included."""
    attn = make(kind, chunk_size=4, window=3)
    d, l = 8, 9
    q, k, v = qkv(lq=l, lk=l, d=d, scale=1.5)
    valid = jnp.ones((2, l), bool).at[1, 3].set(False)
    stats = calibration_stats(attn, d)
    full = compiled(attn, q, k, v, mask=valid, causal=True, stats=stats)
    ctx = compiled(attn.decode_context, d, stats=stats)
    state = compiled(attn.decode_init, 2, 2, d, v.shape[-1])
    steps, states = [], [state]
    step = jax.jit(attn.decode_step)           # one program a step, as generation runs it
    for t in range(l):
        o, state = step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], ctx, valid=valid[:, t])
        steps.append(o)
        states.append(state)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), rtol=2e-4, atol=2e-5)
    # prompts shorter and longer than the band + 1, and one ending on the padded token
    check_prefill(attn, states, q, k, v, ctx, valid, step, jnp.concatenate(steps, 1))


def test_causal_with_fewer_queries_aligns_them_to_the_last_keys():
    attn = make("favor+", chunk_size=4, window=2)
    q, k, v = qkv()
    full = compiled(attn, q, k, v, causal=True)
    tail = compiled(attn, q[:, 5:], k, v, causal=True)
    np.testing.assert_allclose(np.asarray(tail), np.asarray(full[:, 5:]), rtol=1e-5, atol=1e-6)


def test_errors_name_the_bad_value():
    for bad in (-1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="window must be an integer ≥ 0"):
            attention.get("favor+", window=bad)
    q, k, v = qkv(lq=5, lk=9)
    with pytest.raises(ValueError, match="needs Lq = Lk; got 5 and 9"):
        attention.get("favor+", window=2)(q, k, v)
    with pytest.raises(ValueError, match="softmax with window=2: .*needs Lq = Lk; got 5 and 9"):
        attention.get("softmax", window=2)(q, k, v)


def test_config_override_reaches_the_layer():
    from configs import default
    config = default.get_config("runlocal")
    config.model.attention.window = 4
    job.validate(config)
    assert attention.block_options(config.model.attention)["window"] == 4
    config.model.attention.window = -2
    with pytest.raises(loading.ConfigError, match="model.attention.window"):
        job.validate(config)


# -- every linear kind takes the band; the learned (LoLCATs) mix ------------------------------------------
MIX = jnp.asarray([0.7, -2.5])            # logits for 2 heads, away from the start (γ 0.67 and 0.08)


def check_mixed(attn, q, k, v, mask, causal, mix, rng=None, stats=None, rtol=2e-4):
    out = attn(q, k, v, mask=mask, causal=causal, rng=rng, stats=stats, mix=mix)
    ctx = context_of(attn, q, k, mask, rng, causal, stats)
    log_mix = None if not attn.mixes else np.log(1.0 / (1.0 + np.exp(-np.asarray(
        attn.mix_init(q.shape[2]) if mix is None else mix, np.float64))))
    ref, cond = reference.attention(attn, q, k, v, ctx, mask, causal, window=attn.window, log_mix=log_mix)
    out = np.asarray(out, np.float64)
    bound = rtol * cond[..., None] + 1e-30
    bad = np.abs(out - ref) > bound
    assert not bad.any(), (attn.name, causal, float(np.max(np.abs(out - ref) / bound)), np.argwhere(bad)[:3])
    return out


@pytest.mark.parametrize("mix", ["shared", "learned"])
@pytest.mark.parametrize("kind", ["elu", "hedgehog", "t2r", "favor+"])
def test_every_linear_kind_takes_the_band(kind, mix):
    """ELU and the learned maps (their inputs unscaled, the band's scaled) and FAVOR+, each mix, against
    the float64 form with padding, bidirectional and causal; the learned mix at its start (mix=None) and
    at per-head logits away from it."""
    attn = make(kind, chunk_size=4, window=2, window_mix=mix, num_features=8 if kind != "favor+" else 16)
    q, k, v = qkv(scale=1.0, seed=3)
    for causal in (False, True):
        for m in ((None, MIX) if mix == "learned" else (None,)):
            check_mixed(attn, q, k, v, key_mask(), causal, m, rng=jax.random.PRNGKey(3))


def test_the_learned_mix_weighs_the_band():
    """As γ → 1 the band's weights exp(s − m_i) ≤ 1 stay; as γ → 0 the band vanishes and the output is the
    linear part alone (the kind without a window but over the off-band keys only, checked at row 0 of a
    causal pass, which sees its own key alone: the band's only key, so any γ gives v_0)."""
    attn = make("hedgehog", chunk_size=4, window=2, window_mix="learned", num_features=8)
    q, k, v = qkv(b=1, seed=8)
    out = attn(q, k, v, causal=True, mix=jnp.asarray([-40.0, -40.0]))
    np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(v[:, 0]), rtol=1e-5, atol=1e-6)
    # γ = e^-40: the band keys carry nothing wherever an off-band key exists: rows t ≥ 3 are the plain
    # linear attention over keys ≤ t − 3, written here from the map's float64 features
    x = np.swapaxes(np.asarray(q, np.float64), 1, 2)
    y = np.swapaxes(np.asarray(k, np.float64), 1, 2)
    w = np.asarray(attn.init_weights(jax.random.PRNGKey(attn.seed), 2, 8), np.float64)
    soft = lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
    fq = np.concatenate([soft(x @ w[0]), soft(-(x @ w[0]))], -1)
    fk = np.concatenate([soft(y @ w[1]), soft(-(y @ w[1]))], -1)
    a = np.einsum("bhif,bhjf->bhij", fq, fk) * (np.arange(9)[None, :] <= np.arange(9)[:, None] - 3)
    want = np.einsum("bhij,bhjd->bhid", a, np.swapaxes(np.asarray(v, np.float64), 1, 2))
    want = want / np.maximum(a.sum(-1, keepdims=True), 1e-300)
    np.testing.assert_allclose(np.asarray(out)[:, 3:], np.swapaxes(want, 1, 2)[:, 3:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_learned_mix_gradients_equal_those_of_the_explicit_form(causal):
    """d/d(q, k, v, mix) of the learned mix (hedgehog, padding) against float64 autodiff of the explicit
    L×L form, whose band weight σ(a_h)·exp(s_ij − m_i) keeps m_i's gradient (part of the function)."""
    attn = make("hedgehog", chunk_size=4, window=2, window_mix="learned", num_features=8)
    q, k, v = qkv(seed=6, scale=1.0)
    mask = key_mask()
    lin = jax.random.normal(jax.random.PRNGKey(1), v.shape)
    got = jax.jit(jax.grad(lambda q, k, v, m: jnp.sum(attn(q, k, v, mask=mask, causal=causal, mix=m) * lin),
                           (0, 1, 2, 3)))(q, k, v, MIX)
    with jax.enable_x64(True):
        w = jnp.asarray(attn.init_weights(jax.random.PRNGKey(attn.seed), 2, 8), jnp.float64)
        loss = lambda q, k, v, m: jnp.sum(reference.explicit_attention(
            attn, q, k, v, mask, causal, window=2, mix=m, draw=w) * lin)
        want = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*(jnp.asarray(a, jnp.float64) for a in (q, k, v, MIX)))
    for name, a, b in zip(("q", "k", "v", "mix"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-4, err_msg=f"d{name}")
    assert float(jnp.max(jnp.abs(got[3]))) > 1e-3            # the mix is trained by this loss


@pytest.mark.parametrize("kind", ["hedgehog", "elu"])
def test_learned_mix_decoding_equals_the_causal_pass(kind):
    """Token by token with the learned mix (and ELU's / hedgehog's band on scaled inputs) equals the
    causal pass, a padded token included; prefills of every length decode on to the same outputs; a
    future token moves no past output, bit for bit. (A random-feature kind's band decodes through the
    same window code: test_decoding_step_equals_causal_pass.)"""
    attn = make(kind, chunk_size=4, window=3, window_mix="learned", num_features=8 if kind != "favor+" else 16)
    d, l = 8, 9
    q, k, v = qkv(lq=l, lk=l, d=d, scale=1.5)
    valid = jnp.ones((2, l), bool).at[1, 3].set(False)
    full = attn(q, k, v, mask=valid, causal=True, mix=MIX)
    ctx = attn.decode_context(d)
    step = jax.jit(lambda s, q, k, v, valid: attn.decode_step(s, q, k, v, ctx, valid=valid, mix=MIX))
    prefill = jax.jit(attn.decode_prefill)
    for p in (0, 2, 5):
        state = prefill(k[:, :p], v[:, :p], ctx, valid[:, :p])
        outs = []
        for t in range(p, l):
            o, state = step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], valid[:, t])
            outs.append(o)
        np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full[:, p:]), rtol=2e-4,
                                   atol=2e-5, err_msg=f"prompt {p}")
    t = 5
    k2 = k.at[:, t + 1:].set(-3.0 * k[:, t + 1:])
    v2 = v.at[:, t + 1:].set(100.0)
    for path in ("fast", "exact"):
        a = make(kind, chunk_size=4, window=3, window_mix="learned", causal_path=path,
                 num_features=8 if kind != "favor+" else 16)
        np.testing.assert_array_equal(np.asarray(a(q, k, v, causal=True, mix=MIX))[:, :t + 1],
                                      np.asarray(a(q, k2, v2, causal=True, mix=MIX))[:, :t + 1], err_msg=path)


def test_mix_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="unknown window_mix 'lolcats'; valid: 'shared', 'learned'"):
        attention.get("favor+", window=4, window_mix="lolcats")
    with pytest.raises(ValueError, match="favor: window_mix='learned' needs a positive kind"):
        attention.get("favor", window=4, window_mix="learned")
    assert not attention.get("favor+", window_mix="learned").mixes          # no band, nothing to mix
    attn = attention.get("elu", window=2, window_mix="learned")
    assert attn.mixes
    np.testing.assert_allclose(np.asarray(jax.nn.sigmoid(attn.mix_init(3))), 0.1, rtol=1e-6)   # LoLCATs' start


@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window_softmax_is_the_band_alone(causal):
    """softmax with window=w (the "band only" baseline) against float64 softmax over the band's keys,
    written here, with padding (row 0's last queries see only padded keys in their band: output 0)."""
    q, k, v = qkv(scale=1.0, seed=12)
    mask = np.ones((2, 9), bool)
    mask[0, 4:] = False
    mask[1, 2] = False
    out = np.asarray(compiled(attention.get("softmax", window=2), q, k, v, mask=jnp.asarray(mask), causal=causal),
                     np.float64)
    x, y, vv = (np.swapaxes(np.asarray(a, np.float64), 1, 2) for a in (q, k, v))
    s = np.einsum("bhid,bhjd->bhij", x, y) / np.sqrt(8.0)
    rel = np.arange(9)[None, :] - np.arange(9)[:, None]
    keep = (np.abs(rel) <= 2) & ((rel <= 0) if causal else True) & mask[:, None, None, :]
    w = np.where(keep, np.exp(s - s.max(-1, keepdims=True)), 0.0)
    den = w.sum(-1, keepdims=True)
    want = np.swapaxes(np.where(den > 0, (w @ vv) / np.where(den > 0, den, 1.0), 0.0), 1, 2)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert (out[0, 7:] == 0).all() and np.all(np.isfinite(out))        # a band of padded keys only: 0
