"""The fused Pallas kernels (favor.attention.fused), run here in Pallas interpret mode: equal to the float64
reference (tests/reference.py) and to favor's XLA passes, outputs and gradients, at padding, lengths that
are not a multiple of the chunk, widths that are not powers of two, bf16, norms up to 10·√D, L = 1; the
future never moves the past, bit for bit; the prefill state equals XLA's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from favor import attention
from favor.attention import documents, fused, kinds, tpu
from test_attention import calibration_stats, check_against_reference, qkv

# every mechanism the kernel covers: the four kinds and FAVOR#'s variants, antithetic and importance-
# sampled FAVOR+ (a doubled draw; per-head proposals with log-weights)
SPECS = ["favor+", "favor++", "favor#", "favor#:saderf", "favor#:aderf", "simrf"]
EXTRA = [("favor+", {"antithetic": True}), ("favor+", {"importance_sampling": True})]

_MADE = {}


def make(spec, impl="pallas", **opts):
    key = (spec, impl, tuple(sorted(opts.items())))
    if key not in _MADE:
        kind, spec_opts = attention.parse_spec(spec)
        # F = 100: padded to 128 inside the kernel, two feature blocks of 64 (the second part padding);
        # chunk_size only matters to the XLA side
        _MADE[key] = attention.get(kind, num_features=100, impl=impl, chunk_size=4, **spec_opts, **opts)
    return _MADE[key]


def _ctx(attn, q, k, mask, causal, stats):
    return attn.context(q, k, mask, None, None, None, None, stats, causal)


@pytest.mark.parametrize("spec,opts", [(s, {}) for s in SPECS] + EXTRA)
def test_log_linear_forms_equal_the_feature_maps(spec, opts):
    """x'·P + c + r of `log_linear` is the mechanism's own log-feature map, queries and keys, with the
    per-head fits (favor++, favor#) and the shared draw."""
    attn = make(spec, **opts)
    q, k, _ = qkv(b=2, lq=9, lk=9, d=8, seed=1)
    ctx = _ctx(attn, q, k, None, False, None)
    x, y = attn.scaled(q, k)
    for (l, _), (u, r, p, c) in ((attn.query_map(ctx, x), attn.mech.query_log_linear(x, ctx.draw, ctx.params)),
                                 (attn.key_map(ctx, y), attn.mech.key_log_linear(y, ctx.draw, ctx.params))):
        c = c if c.ndim == 1 else c[..., None, :]
        np.testing.assert_allclose(np.asarray(u @ p + c + r[..., None]), np.asarray(l), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec", SPECS)
def test_fused_equals_float64_reference_with_padding(spec, causal):
    """L = 37 (one chunk of 64, part padding; D = 8 and F = 100 padded to 16 and 128), keys padded
    at the end, in the middle and a whole leading run of 20 (the causal reference starts at the first
    valid key), against the float64 reference."""
    attn = make(spec)
    q, k, v = qkv(b=2, lq=37, lk=37, seed=2)
    mask = np.ones((2, 37), bool)
    mask[0, -3:] = False
    mask[1, :20] = False
    mask[1, 25] = False
    check_against_reference(attn, q, k, v, jnp.asarray(mask), causal,
                            stats=calibration_stats(attn, 8) if causal else None)


@pytest.mark.parametrize("causal", [False, True])
def test_several_chunks_equal_the_float64_reference(causal):
    """L = 150 in chunks of 64: three chunks, the carried state and the reference moving between them."""
    attn = make("favor+")
    q, k, v = qkv(b=1, lq=150, lk=150, seed=3, scale=0.9)
    mask = jnp.ones((1, 150), bool).at[0, 70:80].set(False)
    check_against_reference(attn, q, k, v, mask, causal)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec", ["favor+", "favor#"])
def test_large_norms_equal_float64_reference(spec, causal, dtype):
    """||q||, ||k|| from 1 to 10·√D (D = 16) along the sequence and reversed: in causal mode the reversed
    order takes keys far beyond their chunk's reference, where the call must fall back to the exact
    XLA pass (checked: the kernel reports it)."""
    attn = make(spec)
    d, l = 16, 12
    norms = np.linspace(1.0, 10.0 * d ** 0.5, l)
    for order in (norms, norms[::-1]):
        q, k, v = qkv(b=1, lq=l, lk=l, d=d, norms=order, dtype=dtype, seed=9)
        mask = jnp.ones((1, l), bool).at[0, 5].set(False)
        stats = calibration_stats(attn, d, h=2)
        out = check_against_reference(attn, q, k, v, mask, causal, stats=stats,
                                      out_rtol=1e-2 if dtype == jnp.bfloat16 else 0.0)
        assert np.all(np.isfinite(out))
    if causal:
        ctx = _ctx(attn, q, k, mask, True, stats)
        x, y = attn.scaled(q, k)
        _, exceeded = fused.attend(*attn.mech.query_log_linear(x, ctx.draw, ctx.params),
                                   *attn.mech.key_log_linear(y, ctx.draw, ctx.params),
                                   jnp.swapaxes(v, 1, 2), mask, True)
        assert bool(jnp.any(exceeded))


def _value_and_grads(attn, causal, mask, stats, w):
    @jax.jit
    def f(q, k, v):
        loss = lambda q, k, v: jnp.sum(w * attn(q, k, v, mask=mask, causal=causal, stats=stats).astype(jnp.float32))
        return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
    return f


# bf16 for one mechanism: the queries and keys are float32 before any mechanism forms its log-linear maps
# (`scaled`), so bf16 reaches only the values' loads, the accumulation and the casts of the output and its
# gradients, which are the same code for every mechanism. The mechanisms in float32: one per way the kernel
# reads its parameters — one projection for every head (FAVOR+), one per head (FAVOR#), and different query
# and key projections (ADERF). Every mechanism meets the float64 reference (the tests above), and its
# log-linear form its feature map (test_log_linear_forms_equal_the_feature_maps)
XLA_SPECS = ["favor+", "favor#", "favor#:aderf"]


@pytest.mark.parametrize("spec,dtype", [(s, jnp.float32) for s in XLA_SPECS] + [("favor+", jnp.bfloat16)])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_equals_xla_outputs_and_gradients(spec, causal, dtype):
    """The kernel and favor's XLA pass (impl='xla') agree to float32 rounding, outputs and d/d(q, k, v),
    with padding; bf16 inputs give bf16 outputs and gradients."""
    q, k, v = qkv(b=2, lq=70, lk=70, seed=4, dtype=dtype)
    mask = jnp.ones((2, 70), bool).at[0, -5:].set(False).at[1, :20].set(False)
    w = jax.random.normal(jax.random.PRNGKey(5), v.shape)
    stats = calibration_stats(make(spec), 8) if causal else None
    (l1, g1), (l2, g2) = (_value_and_grads(make(spec, impl), causal, mask, stats, w)(q, k, v)
                          for impl in ("xla", "pallas"))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(float(l2), float(l1), rtol=tol * 10, atol=tol * 10)
    for a, b in zip(g1, g2):
        assert b.dtype == dtype
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(a)) + 1e-7, (spec, causal, np.max(np.abs(a - b)))


def _explicit(x, y, v, lx_of, ly_of, causal, mask):
    """float64 attention from explicit weights Σ_f exp(l_x + l_y), written here: no favor code."""
    lx, ly = lx_of(x), ly_of(y)                                                 # [H, L, F]
    lt = lx[:, :, None, :] + ly[:, None, :, :]
    shift = np.max(lt)
    wts = np.sum(np.exp(lt - shift), -1)                                        # [H, Lq, Lk]
    keep = np.asarray(mask, bool)[None, None, :]
    if causal:
        keep = keep & np.tril(np.ones(wts.shape[1:], bool))[None]
    wts = np.where(keep, wts, 0.0)
    return (wts @ v) / np.sum(wts, -1, keepdims=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec", ["favor+", "favor++"])
def test_gradients_equal_float64_finite_differences(spec, causal):
    """d/d(q, k, v) of Σ w·out from the kernel's backward pass against central differences of a float64
    computation from explicit weights (ε = 1e-6, in random directions)."""
    attn = make(spec)
    b, l, h, d, dv = 1, 40, 2, 8, 5
    q, k, v = qkv(b=b, lq=l, lk=l, h=h, d=d, dv=dv, seed=6)
    mask = jnp.ones((b, l), bool).at[0, 7].set(False)
    stats = calibration_stats(attn, d) if causal else None
    ctx = _ctx(attn, q, k, mask, causal, stats)
    omega, log_w = np.asarray(ctx.draw.omega, np.float64), np.asarray(ctx.draw.log_weights, np.float64)
    tq, tk, a = (np.asarray(p, np.float64) for p in (ctx.params.tq, ctx.params.tk, ctx.params.a))
    sel = lambda p: p[0] if p.ndim >= 3 and p.shape[0] == b else p          # batch 1: [H, ...] or shared
    lx_of = lambda x: reference.exponential_log_features(x, sel(tq), sel(a), omega, log_w)
    ly_of = lambda y: reference.exponential_log_features(y, sel(tk), sel(a), omega, log_w)
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (b, l, h, dv)), np.float64)

    def loss64(q, k, v):
        s = d ** -0.25
        x, y, vv = (np.swapaxes(np.asarray(t, np.float64), 1, 2)[0] for t in (q, k, v))
        out = _explicit(x * s, y * s, vv, lx_of, ly_of, causal, np.asarray(mask)[0])
        return float(np.sum(np.swapaxes(w, 1, 2)[0] * out))

    _, grads = _value_and_grads(attn, causal, mask, stats, jnp.asarray(w, jnp.float32))(q, k, v)
    rng = np.random.default_rng(0)
    args = [np.asarray(t, np.float64) for t in (q, k, v)]
    for i, g in enumerate(grads):
        for _ in range(2):
            direction = rng.standard_normal(args[i].shape)
            plus, minus = list(args), list(args)
            plus[i], minus[i] = args[i] + 1e-6 * direction, args[i] - 1e-6 * direction
            fd = (loss64(*plus) - loss64(*minus)) / 2e-6
            got = float(np.sum(np.asarray(g, np.float64) * direction))
            assert abs(got - fd) <= 2e-4 * (abs(fd) + np.linalg.norm(np.asarray(g)) * 1e-2), (i, got, fd)


@pytest.mark.parametrize("spec", ["favor+", "favor#"])
def test_the_future_never_moves_the_past_bit_for_bit(spec):
    """Tokens from position t on replaced (q, k, v; t inside a chunk and at a chunk's start): every output
    before t is the same float32, and so is every gradient reaching q, k, v before t from those outputs."""
    attn = make(spec)
    l = 150
    q, k, v = qkv(b=1, lq=l, lk=l, seed=8, scale=0.9)
    stats = calibration_stats(attn, 8)
    q2, k2, v2 = qkv(b=1, lq=l, lk=l, seed=18, scale=0.9)
    run = jax.jit(lambda q, k, v: attn(q, k, v, causal=True, stats=stats))
    grad = jax.jit(jax.grad(lambda q, k, v, t: jnp.sum(jnp.where(jnp.arange(l)[None, :, None, None] < t,
                                                                 attn(q, k, v, causal=True, stats=stats), 0.0)),
                            (0, 1, 2)))
    base = np.asarray(run(q, k, v))
    for t in (1, 45, 64, 128):
        mix = lambda a, b: a.at[:, t:].set(b[:, t:])
        qm, km, vm = mix(q, q2), mix(k, k2), mix(v, v2)
        out = np.asarray(run(qm, km, vm))
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        g1, g2 = grad(q, k, v, t), grad(qm, km, vm, t)
        for a, b in zip(g1, g2):
            np.testing.assert_array_equal(np.asarray(a)[:, :t], np.asarray(b)[:, :t])


@pytest.mark.parametrize("causal", [False, True])
def test_invariants(causal):
    """Identical keys give mean(v) over the valid keys; causal position 0 outputs v_0; L = 1."""
    attn = make("favor+")
    q, k, v = qkv(b=1, lq=20, lk=20, seed=10, d=16, norms=np.full(20, 8.0))
    k = jnp.broadcast_to(k[:, :1], k.shape)
    mask = jnp.ones((1, 20), bool).at[0, 3].set(False)
    out = np.asarray(attn(q, k, v, mask=mask, causal=causal), np.float64)
    vv = np.asarray(v, np.float64)
    if causal:
        np.testing.assert_allclose(out[:, 0], vv[:, 0], rtol=1e-5, atol=1e-6)
        counts = np.cumsum(np.asarray(mask, np.float64)[0])
        means = np.cumsum(vv[0] * np.asarray(mask, np.float64)[0][:, None, None], 0) / counts[:, None, None]
        np.testing.assert_allclose(out[0], means, rtol=1e-4, atol=1e-5)
    else:
        mean = np.sum(vv * np.asarray(mask)[..., None, None], 1) / 19
        np.testing.assert_allclose(out, np.broadcast_to(mean[:, None], out.shape), rtol=1e-4, atol=1e-5)
    q1, k1, v1 = qkv(b=2, lq=1, lk=1, seed=11)
    np.testing.assert_allclose(np.asarray(attn(q1, k1, v1, causal=causal)), np.asarray(v1), rtol=1e-5, atol=1e-6)


def test_padding_only_rows_output_zero_with_finite_gradients():
    attn = make("favor+")
    q, k, v = qkv(b=2, lq=20, lk=20, seed=12)
    mask = jnp.ones((2, 20), bool).at[1].set(False)
    for causal in (False, True):
        loss = lambda q, k, v: jnp.sum(attn(q, k, v, mask=mask, causal=causal) ** 2)
        out, grads = jax.jit(lambda q, k, v: (attn(q, k, v, mask=mask, causal=causal),
                                              jax.grad(loss, (0, 1, 2))(q, k, v)))(q, k, v)
        np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
        assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


@pytest.mark.parametrize("spec", ["favor+", "favor++"])
def test_prefill_equals_xla_and_decoding_continues_it(spec):
    """The kernel's prefill state is XLA's (τ and the sums), and decoding from it equals the causal pass."""
    fast, slow = make(spec), make(spec, "xla")
    q, k, v = qkv(b=2, lq=30, lk=30, seed=13)
    mask = jnp.ones((2, 30), bool).at[0, 2].set(False)
    stats = calibration_stats(fast, 8)
    ctx = fast.decode_context(8, stats=stats)
    s1, s2 = fast.decode_prefill(k[:, :25], v[:, :25], ctx, mask[:, :25]), slow.decode_prefill(k[:, :25], v[:, :25], ctx, mask[:, :25])
    assert set(s1) == set(s2)
    np.testing.assert_allclose(np.asarray(s1["tau"]), np.asarray(s2["tau"]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s1["sum"]), np.asarray(s2["sum"]), rtol=2e-5, atol=1e-6)
    whole = np.asarray(slow(q, k, v, mask=mask, causal=True, stats=stats))
    state = s1
    for t in range(25, 30):
        out, state = fast.decode_step(state, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], ctx, mask[:, t])
        np.testing.assert_allclose(np.asarray(out[:, 0]), whole[:, t], rtol=1e-4, atol=1e-5)


def test_impl_option():
    """Unknown impl values and what the kernel does not cover are errors naming what is allowed; 'auto'
    stays on XLA on CPU."""
    with pytest.raises(ValueError, match="impl.*'auto', 'xla', 'pallas'"):
        attention.get("favor+", impl="cuda")
    with pytest.raises(ValueError, match="favor\\+, favor\\+\\+, favor#, simrf"):
        attention.get("favor", impl="pallas")
    with pytest.raises(ValueError, match="window"):
        attention.get("favor+", impl="pallas", window=4)
    with pytest.raises(ValueError, match="fit_gradients"):
        attention.get("favor++", impl="pallas", fit_gradients=True)
    with pytest.raises(ValueError, match="'pallas-tf32x3', 'pallas-bf16'"):
        attention.get("favor+", impl="pallas-fp8")
    assert attention.get("favor+", impl="pallas-bf16").kernel_precision == "bf16"
    assert attention.get("favor+", impl="pallas").kernel_precision is None          # fused.PRECISION
    q, k, _ = qkv()
    assert not attention.get("favor+").uses_fused(False, q, k)          # auto, on CPU
    assert "cpu" not in kinds.AUTO_FUSED
    assert attention.get("favor+", impl="pallas").uses_fused(True, q, k)
    assert not attention.get("favor+", impl="xla").uses_fused(True, q, k)
    # what the kernel does not cover, said in one line: kinds without a kernel, queries after a prefix
    for kind in ("relu", "elu", "hedgehog", "t2r"):
        with pytest.raises(ValueError, match=f"^attention kind '{kind}': impl .*favor\\+, favor\\+\\+, favor#, "
                                             f"simrf\\); {kind} runs on XLA, with no impl option$"):
            attention.get(kind, impl="pallas")
    with pytest.raises(ValueError, match="^favor\\+: impl='pallas' runs causal calls with as many queries as "
                                         "keys \\(got Lq = 4, Lk = 9"):
        attention.get("favor+", impl="pallas")(q[:, :4], k, k, causal=True)
    auto = attention.get("favor+")
    assert not auto.uses_fused(True, q[:, :4], k)                     # 'auto': XLA, quietly


def test_auto_follows_the_measured_table(monkeypatch):
    """'auto' runs the kernel exactly where AUTO_FUSED lists the backend, the mode and a key length up to
    the call's; never for a kind or option the kernel does not cover."""
    monkeypatch.setitem(kinds.AUTO_FUSED, jax.default_backend(), {"bidirectional": 16})
    q, k, v = qkv(b=1, lq=20, lk=20, seed=30)
    auto = attention.get("favor+", num_features=32, redraw="fixed")
    assert auto.uses_fused(False, q, k)
    assert not auto.uses_fused(False, q[:, :8], k[:, :8])               # shorter than measured
    assert not auto.uses_fused(True, q, k)                              # causal: not listed
    assert not attention.get("favor", num_features=32).uses_fused(False, q, k)   # no kernel for trig
    assert not attention.get("favor+", num_features=32, window=2).uses_fused(False, q, k)
    np.testing.assert_allclose(np.asarray(auto(q, k, v)), np.asarray(
        attention.get("favor+", num_features=32, redraw="fixed", impl="pallas")(q, k, v)), rtol=0, atol=0)
    monkeypatch.setitem(kinds.AUTO_FUSED, jax.default_backend(), {"causal": 16})
    assert auto.uses_fused(True, q, k) and not auto.uses_fused(False, q, k)
    assert not auto.uses_fused(True, q[:, :8], k[:, :8])
    np.testing.assert_allclose(np.asarray(auto(q, k, v, causal=True)), np.asarray(
        attention.get("favor+", num_features=32, redraw="fixed", impl="pallas")(q, k, v, causal=True)), rtol=0, atol=0)


def test_softmax_impl_option():
    """softmax's impl: cuDNN only where it applies (a GPU, bf16/fp16, equal head dims of 64 or 128, no padding
    mask), 'auto' falls back to XLA, a forced 'cudnn' elsewhere is an error saying what it needs."""
    q, k, v = qkv()
    out = np.asarray(attention.get("softmax")(q, k, v, causal=True))
    np.testing.assert_array_equal(np.asarray(attention.get("softmax", impl="xla")(q, k, v, causal=True)), out)
    with pytest.raises(ValueError, match="impl='cudnn' needs a GPU"):
        attention.get("softmax", impl="cudnn")(q, k, v)
    with pytest.raises(ValueError, match="impl.*'auto', 'xla', 'cudnn'"):
        attention.get("softmax", impl="pallas")


def test_config_impl_override():
    """`--config.model.attention.impl=pallas` reaches the layer; on a kind the kernel does not cover it is a
    config error naming the key, the value and why."""
    from favor import job
    from favor.config import loading
    config = loading.load("configs/default.py")
    loading.apply_flag(config, "--config.model.attention.impl=pallas")
    job.validate(config)
    assert attention.block_options(config.model.attention)["impl"] == "pallas"
    loading.apply_flag(config, "--config.model.attention.kind=favor")
    with pytest.raises(loading.ConfigError, match="model.attention.impl='pallas'.*positive exponential kinds"):
        job.validate(config)


@pytest.mark.parametrize("family", ["decoder", "bert"])
def test_models_train_through_the_kernel(family):
    """A zoo model with impl='pallas' (causal decoder, bidirectional BERT with padding) gives the loss and
    parameter gradients of the same model on XLA."""
    from flax import nnx
    from favor import models
    ids = jax.random.randint(jax.random.PRNGKey(0), (2, 40), 0, 200)
    mask = jnp.ones((2, 40), bool).at[1, 30:].set(False)
    results = []
    for impl in ("xla", "pallas"):
        model = models.get(family, "tiny", attention={"kind": "favor+", "num_features": 32, "impl": impl},
                           rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            out = nnx.merge(graphdef, params, rest)(ids, attention_mask=mask)
            logits = out["logits"] if isinstance(out, dict) else out
            return jnp.mean(logits.astype(jnp.float32) ** 2)
        results.append(jax.jit(jax.value_and_grad(loss))(params))
    (l1, g1), (l2, g2) = results
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)) + 1e-9


def test_fallback_gradients_are_finite_and_equal_xla():
    """Keys far beyond their chunk's reference (‖q‖, ‖k‖ ≈ 10·√D, F = 128: two feature blocks): the kernel
    reports it, the call takes the exact XLA path, and the gradients are XLA's: the discarded kernel
    gradient must stay finite (a feature block whose denominator underflows could give 0·inf = NaN)."""
    rng = np.random.default_rng(3)
    q, k = (jnp.asarray(rng.standard_normal((1, 128, 1, 16)) * 10, jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 128, 1, 4)), jnp.float32)
    got = []
    for impl in ("xla", "pallas"):
        attn = attention.get("favor+", num_features=128, impl=impl, redraw="fixed")
        got.append(jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v, causal=True)), (0, 1, 2)))(q, k, v))
    attn = attention.get("favor+", num_features=128, impl="pallas", redraw="fixed")
    ctx = _ctx(attn, q, k, None, True, None)
    x, y = attn.scaled(q, k)
    _, exceeded = fused.attend(*attn.mech.query_log_linear(x, ctx.draw, ctx.params),
                               *attn.mech.key_log_linear(y, ctx.draw, ctx.params), jnp.swapaxes(v, 1, 2), None, True)
    exceeded = np.asarray(exceeded)
    assert exceeded.shape == (1, 1, 128) and exceeded.any() and not exceeded[0, 0, 0]
    assert np.all(np.diff(exceeded.astype(int), axis=-1) >= 0)      # once a row exceeds, every later one
    (l1, g1), (l2, g2) = got
    assert abs(float(l1) - float(l2)) <= 1e-5 * abs(float(l1))     # the kernel's rows before the first excess
    for a, b in zip(g1, g2):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(b))
        assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(a))


def _beyond_the_bound_case(spec, d=16, l=64, t=45, seed=40):
    """Queries and values at random, keys all one direction of norm 5·√D (well inside the chunk form's
    bound), and the same with one ordinary key (N(0, 1) entries) at position t in batch 0, head 0: its
    log-features exceed the big keys' by far more than e^EXCEEDANCE."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, l, 2, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, l, 2, 4)), jnp.float32)
    unit = rng.standard_normal(d)
    k = jnp.asarray(np.broadcast_to(unit / np.linalg.norm(unit) * 5 * d ** 0.5, (2, l, 2, d)), jnp.float32)
    moved = k.at[0, t, 0].set(jnp.asarray(rng.standard_normal(d), jnp.float32))
    return q, k, moved, v


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("spec", ["favor+", "simrf"])
def test_a_key_beyond_the_bound_moves_no_earlier_row_and_no_other_example(spec, impl):
    """The exact path is chosen per row: with the ordinary key at t = 45 only the rows of that example and
    head from t on take it. Every other output — the rows before t, the other example, the other head — is
    bit for bit the call's without that key, and the rows from t on equal the float64 reference. (The
    decision was once one for the whole call, which moved all of them at rounding level.)"""
    attn = make(spec, impl=impl)
    t = 45
    q, k, moved, v = _beyond_the_bound_case(spec, t=t)
    run = jax.jit(lambda q, k, v: attn(q, k, v, causal=True))
    base, out = np.asarray(run(q, k, v)), np.asarray(run(q, moved, v))
    if impl == "pallas":
        ctx = _ctx(attn, q, moved, None, True, None)
        x, y = attn.scaled(q, moved)
        flags = [np.asarray(fused.attend(*attn.mech.query_log_linear(x, ctx.draw, ctx.params),
                                         *attn.mech.key_log_linear(yy, ctx.draw, ctx.params), jnp.swapaxes(v, 1, 2),
                                         None, True)[1]) for yy in (attn.scaled(q, k)[1], y)]
        assert not flags[0].any()                                   # the big keys alone: the kernel's rows
        want = np.zeros((2, 2, 64), bool)
        want[0, 0, t:] = True
        np.testing.assert_array_equal(flags[1], want)
    np.testing.assert_array_equal(out[0, :t], base[0, :t])
    np.testing.assert_array_equal(out[0, :, 1], base[0, :, 1])
    np.testing.assert_array_equal(out[1], base[1])
    ref, cond = reference.attention(attn, q, moved, v, _ctx(attn, q, moved, None, True, None), None, True)
    err = (np.abs(out - ref) / (2e-4 * cond[..., None] + 1e-30))[0, t:, 0]
    assert np.max(err) <= 1, (np.max(err), np.argwhere(err > 1)[:3])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_a_key_beyond_the_bound_moves_no_other_document(impl, causal):
    """Packed documents [0, 20) and [20, 64) with the ordinary key at 10: the second document's rows (and,
    causal, the first's before 10) are bit for bit the call's without it, both modes. Spans of 32 tokens on
    the XLA pass: the second document starts inside the span that holds the key and continues into the next
    on the carry (once taken from the exact path for the whole span, which moved its later rows)."""
    attn = make("favor+", impl=impl, causal_span=32)
    q, k, moved, v = _beyond_the_bound_case("favor+", t=10)
    ids = jnp.asarray(np.repeat([[0] * 20 + [1] * 44], 2, axis=0))
    run = jax.jit(lambda q, k, v: attn(q, k, v, causal=causal, segment_ids=ids))
    base, out = np.asarray(run(q, k, v)), np.asarray(run(q, moved, v))
    np.testing.assert_array_equal(out[:, 20:], base[:, 20:])
    np.testing.assert_array_equal(out[1], base[1])
    if causal:
        np.testing.assert_array_equal(out[:, :10], base[:, :10])
    ctx = _ctx(attn, q, moved, None, causal, None)
    ref, cond = reference.attention(attn, q, moved, v, ctx, None, causal, segment_ids=np.asarray(ids))
    err = np.abs(out - ref) / (2e-4 * cond[..., None] + 1e-30)
    assert np.max(err) <= 1, (np.max(err), np.argwhere(err > 1)[:3])


@pytest.mark.parametrize("kernels", ["triton-path", "tpu"])
def test_padded_features_never_set_a_keys_scale(kernels):
    """A map whose row term jumps by 50 between keys while every real log-feature stays 0 (D = 1, F = 24,
    padded to 32 on the Triton path, 128 on the TPU's): the padded features' l_k − τ0 is that jump, which
    must not count as a key exceeding its reference (it would flag the rows and scale the key's weight by
    e^(40 − 50))."""
    l, f = 8, 24
    xk = np.zeros((1, 1, l, 1), np.float32)
    xk[0, 0, 0, 0] = 50.0
    rk = np.zeros((1, 1, l), np.float32)
    rk[0, 0, 0] = -50.0                                 # l_k(j, f) = 0 for every key and real feature
    ones, zeros = np.ones((1, f), np.float32), np.zeros((f,), np.float32)
    v = np.arange(l, dtype=np.float32).reshape(1, 1, l, 1)
    attend = fused.attend if kernels == "triton-path" else functools.partial(tpu.attend, cut=(8, 128))
    out, exceeded = attend(jnp.zeros((1, 1, l, 1)), jnp.zeros((1, 1, l)), ones, zeros, xk, rk, ones, zeros, v,
                           None, True)
    assert not bool(jnp.any(exceeded))
    np.testing.assert_allclose(np.asarray(out)[0, 0, :, 0], np.arange(l) / 2.0, rtol=1e-6)   # mean of v_0..v_i


def _log_linear_case(seed, b=1, h=2, l=120, d=4, f=24, dv=3, growth=3.0):
    """Random log-linear maps (log φ = x·P + c + r, r = −½||x||² as FAVOR+'s) over L = 120 in chunks of
    16 (the kernel's smallest: 8 chunks, the last part padding), the key norms growing along the sequence
    so that the reference moves from segment to segment; a leading run of 40 padded keys (with segments
    of one or two chunks the first segments see no key at all), one padded key in the middle."""
    rng = np.random.default_rng(seed)
    scale = np.linspace(0.3, growth, l)[None, None, :, None]
    xq, xk = (rng.standard_normal((b, h, l, d)) * scale for _ in range(2))
    p = rng.standard_normal((h, d, f)) * 0.7
    c = rng.standard_normal((h, f)) * 0.3
    v = rng.standard_normal((b, h, l, dv))
    mask = np.ones((b, l), bool)
    mask[:, :40] = False
    mask[:, 77] = False
    rq, rk = -0.5 * np.sum(xq ** 2, -1), -0.5 * np.sum(xk ** 2, -1)
    return xq, rq, p, c, xk, rk, p, c, v, mask


def _attend64(xq, rq, pq, cq, xk, rk, pk, ck, v, mask, causal, docs=None):
    """float64 attention over weights Σ_f exp(l_q(i, f) + l_k(j, f)), written here; `docs` [B, L]: each
    position's document id, pairs across documents carrying no weight."""
    lq = np.einsum("bhld,hdf->bhlf", xq, pq) + cq[None, :, None] + rq[..., None]
    lk = np.einsum("bhld,hdf->bhlf", xk, pk) + ck[None, :, None] + rk[..., None]
    lt = lq[:, :, :, None, :] + lk[:, :, None, :, :]
    top = np.max(lt, axis=-1, keepdims=True)
    logit = (top + np.log(np.sum(np.exp(lt - top), -1, keepdims=True)))[..., 0]        # [B, H, Lq, Lk]
    keep = mask[:, None, None, :] & (np.tril(np.ones(logit.shape[2:], bool)) if causal else True)
    if docs is not None:
        keep = keep & (docs[:, None, :, None] == docs[:, None, None, :])
    logit = np.where(keep, logit, -np.inf)
    m = np.max(logit, -1, keepdims=True)
    wts = np.where(keep, np.exp(logit - np.where(np.isfinite(m), m, 0.0)), 0.0)
    den = np.sum(wts, -1, keepdims=True)
    return np.where(den > 0, (wts @ v) / np.where(den > 0, den, 1.0), 0.0)


CHUNK16 = 16        # the kernel's smallest chunk (fused._pow2's floor)


def _attend32(args, causal, segments):
    xq, rq, pq, cq, xk, rk, pk, ck, v, mask = args
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    cut = (CHUNK16, *fused.tuning(causal, fused.PRECISION)[1:])         # the table's cut, chunks of 16
    return fused.attend(f32(xq), f32(rq), f32(pq), f32(cq), f32(xk), f32(rk), f32(pk), f32(ck), f32(v),
                        jnp.asarray(mask), causal, segments=segments, cut=cut)


@pytest.mark.parametrize("causal", [False, True])
def test_segments_equal_the_float64_reference_and_each_other(causal):
    """One segment, segments of several chunks and of one chunk (S = 1, 2, 4, 8 over 8 chunks of 16; the
    first segments see only padded keys): the float64 reference's outputs, and gradients equal to the
    one-segment pass's (the carried state and the query sums entering each segment are the sequential
    pass's, up to float32 rounding)."""
    assert [fused._segments(8 * 16, 16, 1, s) for s in (1, 2, 4, 8)] == [(s, 128) for s in (1, 2, 4, 8)]
    args = _log_linear_case(20)
    want = _attend64(*args, causal)
    w = jnp.asarray(np.random.default_rng(21).standard_normal(want.shape), jnp.float32)

    def diff(xq, rq, xk, rk, v, s):
        out, exceeded = _attend32((xq, rq, args[2], args[3], xk, rk, args[6], args[7], v, args[9]), causal, s)
        return jnp.sum(w * out), (out, exceeded)

    # one program per segment count: outputs and gradients together (eager, the pass's glue ops dispatch
    # one by one)
    program = jax.jit(jax.value_and_grad(diff, (0, 1, 2, 3, 4), has_aux=True), static_argnums=5)
    base = None
    for s in (1, 2, 4, 8):
        (_, (out, exceeded)), grads = program(*(jnp.asarray(args[i], jnp.float32) for i in (0, 1, 4, 5, 8)), s)
        assert not bool(jnp.any(exceeded))
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5 * np.max(np.abs(want)))
        if base is None:
            base = grads
            continue
        # d/dr_q is 0 in exact arithmetic (a row's constant cancels in its ratio): its rounding is measured
        # against the largest gradient
        top = max(float(np.max(np.abs(np.asarray(a)))) for a in base)
        for i, (a, b) in enumerate(zip(base, grads)):
            a, b = np.asarray(a), np.asarray(b)
            bound = 1e-6 * top if i == 1 else 1e-5 * np.max(np.abs(a))
            assert np.max(np.abs(a - b)) <= bound, (s, i, np.max(np.abs(a - b)))


@pytest.mark.parametrize("causal", [False, True])
def test_segment_gradients_equal_float64_finite_differences(causal):
    """Four segments of two chunks (L = 120): d/d(x_q, x_k, r_k, v) of Σ w·out against central
    differences of the float64 reference (ε = 1e-6, random directions); d/dr_q, 0 in exact arithmetic (a
    row's constant cancels in its ratio), is rounding beside the others."""
    args = _log_linear_case(22, growth=2.0)
    w = np.random.default_rng(23).standard_normal(_attend64(*args, causal).shape)
    loss32 = lambda xq, rq, xk, rk, v: jnp.sum(jnp.asarray(w, jnp.float32) * _attend32(
        (xq, rq, args[2], args[3], xk, rk, args[6], args[7], v, args[9]), causal, 4)[0])
    which = (0, 1, 4, 5, 8)
    grads = jax.jit(jax.grad(loss32, tuple(range(5))))(*(jnp.asarray(args[i], jnp.float32) for i in which))
    rng = np.random.default_rng(24)
    assert np.max(np.abs(np.asarray(grads[1]))) <= 1e-5 * np.max(np.abs(np.asarray(grads[0])))
    for g, i in [(g, i) for g, i in zip(grads, which) if i != 1]:
        direction = rng.standard_normal(args[i].shape)
        moved = lambda e: float(np.sum(w * _attend64(*[a + e * direction if j == i else a
                                                        for j, a in enumerate(args)], causal)))
        fd = (moved(1e-6) - moved(-1e-6)) / 2e-6
        got = float(np.sum(np.asarray(g, np.float64) * direction))
        assert abs(got - fd) <= 2e-4 * (abs(fd) + np.linalg.norm(np.asarray(g)) * 1e-2), (i, got, fd)


def test_segments_keep_the_future_from_the_past_bit_for_bit():
    """Four segments of two chunks of 16: tokens from t on replaced (t inside a chunk, at a chunk's start
    inside a segment, at a segment's start, in the padded run and after it): outputs before t and the
    gradients reaching the inputs before t, bit for bit."""
    args = _log_linear_case(25)
    other = _log_linear_case(26)
    l = args[0].shape[2]
    w = jnp.asarray(np.random.default_rng(27).standard_normal((1, 2, l, 3)), jnp.float32)

    @jax.jit        # one program for every t and both inputs (t is data: the loss weighs outputs before it)
    def run(xq, rq, xk, rk, v, t):
        def loss(xq, rq, xk, rk, v):
            out = _attend32((xq, rq, args[2], args[3], xk, rk, args[6], args[7], v, args[9]), True, 4)[0]
            return jnp.sum(jnp.where(jnp.arange(l)[:, None] < t, w, 0.0) * out), out
        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True)(xq, rq, xk, rk, v)
        return out, grads

    pick = lambda a: [jnp.asarray(a[i], jnp.float32) for i in (0, 1, 4, 5, 8)]
    for t in (3, 16, 32, 45, 64, 100):
        mixed = [a.copy() for a in args]
        for i in (0, 1, 4, 5, 8):
            mixed[i][:, :, t:] = other[i][:, :, t:]
        (o1, g1), (o2, g2) = run(*pick(args), t), run(*pick(mixed), t)
        np.testing.assert_array_equal(np.asarray(o1)[:, :, :t], np.asarray(o2)[:, :, :t])
        for a, b in zip(g1, g2):
            np.testing.assert_array_equal(np.asarray(a)[:, :, :t], np.asarray(b)[:, :, :t])


# Documents for the kernel tests: row 0 starts documents at 0 (inside the leading 40 padded keys), 16
# (a chunk's start), 37, 38 (one token), 64 (a chunk's start) and 70; row 1 at 0, 50 and 100, and ends
# with 10 more padded keys (chunks of 16 over L = 120)
DOC_STARTS = ((0, 16, 37, 38, 64, 70), (0, 50, 100))


def _doc_case(seed):
    args = list(_log_linear_case(seed, b=2, growth=2.0))
    l = args[0].shape[2]
    docs = np.zeros((2, l), np.int64)
    for b, starts in enumerate(DOC_STARTS):
        for i, s in enumerate(starts):
            docs[b, s:] = i
    args[9] = args[9].copy()
    args[9][1, 110:] = False
    return args, docs


def _attend_docs32(args, causal, docs):
    xq, rq, pq, cq, xk, rk, pk, ck, v, mask = args
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    cut = (CHUNK16, *fused.tuning(True, fused.PRECISION)[1:])
    return fused.attend(f32(xq), f32(rq), f32(pq), f32(cq), f32(xk), f32(rk), f32(pk), f32(ck), f32(v),
                        jnp.asarray(mask), causal, cut=cut, runs=documents.runs(jnp.asarray(docs, jnp.int32)))


@pytest.mark.parametrize("causal", [False, True])
def test_documents_equal_the_float64_reference_outputs_and_gradients(causal):
    """The document kernels (runs; chunks of 16 over L = 120, documents starting inside chunks and at their
    starts, one of one token, one wholly in padding, padding inside and after documents): the float64
    reference with the document mask, and d/d(x_q, x_k, r_k, v) of Σ w·out against its central
    differences (ε = 1e-6, random directions); d/dr_q, 0 in exact arithmetic, rounding beside the others.
    Bidirectional runs the causal pass and the reversed one over shifted keys: both are checked here."""
    args, docs = _doc_case(30)
    want = _attend64(*args, causal, docs)
    w = np.random.default_rng(31).standard_normal(want.shape)
    which = (0, 1, 4, 5, 8)

    def loss32(xq, rq, xk, rk, v):
        out, exceeded = _attend_docs32((xq, rq, args[2], args[3], xk, rk, args[6], args[7], v, args[9]), causal,
                                       docs)
        return jnp.sum(jnp.asarray(w, jnp.float32) * out), (out, exceeded)

    (_, (out, exceeded)), grads = jax.jit(jax.value_and_grad(loss32, tuple(range(5)), has_aux=True))(
        *(jnp.asarray(args[i], jnp.float32) for i in which))
    assert not bool(jnp.any(exceeded))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5 * np.max(np.abs(want)))
    rng = np.random.default_rng(32)
    assert np.max(np.abs(np.asarray(grads[1]))) <= 1e-5 * np.max(np.abs(np.asarray(grads[0])))
    for g, i in [(g, i) for g, i in zip(grads, which) if i != 1]:
        direction = rng.standard_normal(args[i].shape)
        moved = lambda e: float(np.sum(w * _attend64(*[a + e * direction if j == i else a
                                                        for j, a in enumerate(args)], causal, docs)))
        fd = (moved(1e-6) - moved(-1e-6)) / 2e-6
        got = float(np.sum(np.asarray(g, np.float64) * direction))
        assert abs(got - fd) <= 2e-4 * (abs(fd) + np.linalg.norm(np.asarray(g)) * 1e-2), (causal, i, got, fd)


def test_documents_keep_the_future_and_other_documents_out_bit_for_bit():
    """The causal document kernels: tokens from t on replaced (t inside a document inside a chunk, at a
    chunk's start inside a document, at a document's start at a chunk's start, at the one-token document)
    leave outputs before t and the gradients reaching inputs before t unchanged bit for bit; bidirectional,
    a document replaced leaves every other document's outputs unchanged bit for bit."""
    args, docs = _doc_case(33)
    other, _ = _doc_case(34)
    l = args[0].shape[2]
    w = jnp.asarray(np.random.default_rng(35).standard_normal((2, 2, l, 3)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=6)
    def run(xq, rq, xk, rk, v, t, causal):
        def loss(xq, rq, xk, rk, v):
            out = _attend_docs32((xq, rq, args[2], args[3], xk, rk, args[6], args[7], v, args[9]), causal, docs)[0]
            return jnp.sum(jnp.where(jnp.arange(l)[:, None] < t, w, 0.0) * out), out
        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True)(xq, rq, xk, rk, v)
        return out, grads

    pick = lambda a: [jnp.asarray(a[i], jnp.float32) for i in (0, 1, 4, 5, 8)]
    for t in (20, 32, 38, 64, 90):
        mixed = [a.copy() for a in args]
        for i in (0, 1, 4, 5, 8):
            mixed[i][:, :, t:] = other[i][:, :, t:]
        (o1, g1), (o2, g2) = run(*pick(args), t, True), run(*pick(mixed), t, True)
        np.testing.assert_array_equal(np.asarray(o1)[:, :, :t], np.asarray(o2)[:, :, :t], err_msg=f"t={t}")
        for a, b in zip(g1, g2):
            np.testing.assert_array_equal(np.asarray(a)[:, :, :t], np.asarray(b)[:, :, :t], err_msg=f"t={t}")
    o1 = run(*pick(args), 0, False)[0]
    for s, e in ((16, 37), (38, 39), (64, 70)):
        mixed = [a.copy() for a in args]
        for i in (0, 1, 4, 5, 8):
            mixed[i][0, :, s:e] = other[i][0, :, s:e]
        o2 = np.asarray(run(*pick(mixed), 0, False)[0])
        keep = np.ones(l, bool)
        keep[s:e] = False
        np.testing.assert_array_equal(np.asarray(o1)[:, :, keep], o2[:, :, keep], err_msg=f"document [{s}, {e})")


def test_segment_count():
    """(segments, padded rows): up to what fills SEGMENT_PROGRAMS programs, at most MAX_SEGMENTS, of equal
    whole chunks, padded by less than one chunk per segment; a call with enough programs is not split. A
    prime number of chunks keeps its parallelism (it once ran as one segment)."""
    c = 16
    assert fused._segments(256 * c, c, 64) == (8, 256 * c)
    assert fused._segments(3 * c, c, 8) == (3, 3 * c)
    assert fused._segments(18 * c, c, 64) == (6, 18 * c)
    assert fused._segments(4096 * c, c, 1) == (fused.MAX_SEGMENTS, 4096 * c)
    assert fused._segments(16 * c, c, 1024) == (1, 16 * c)
    assert fused._segments(12 * c, c, 1, want=5) == (4, 12 * c)
    assert fused._segments(67 * c, c, 2) == (34, 68 * c)
    assert fused._segments(67 * c - 5, c, 16) == (23, 69 * c)          # 32 wanted: 23 segments of 3 chunks
    assert fused._segments(c + 1, c, 1) == (2, 2 * c)
    for n in range(1, 300):
        s, rows = fused._segments(n * c, c, 4)
        per = rows // c // s
        assert rows % (s * c) == 0 and rows >= n * c and rows - n * c < per * c and s <= min(n, 64)


@pytest.mark.parametrize("causal", [False, True])
def test_kernels_lower_for_gpus(causal):
    """Every kernel lowers through Pallas' Triton path for CUDA (lowering needs no GPU): forward, backward
    and prefill, one segment and several, bf16 inputs. Interpret mode accepts operations Triton does not
    (a bool cast to float, say); this catches them before a GPU does."""
    rng = np.random.default_rng(31)
    b, h, l, d, f, dv = 1, 2, 256, 16, 96, 16
    x = jnp.asarray(rng.standard_normal((b, h, l, d)), jnp.bfloat16)
    r, v = jnp.zeros((b, h, l)), jnp.asarray(rng.standard_normal((b, h, l, dv)), jnp.float32)
    p, c = jnp.asarray(rng.standard_normal((h, d, f)), jnp.float32), jnp.zeros((h, f))
    # each precision is cut and launched its own way (fused.TUNING): its tile shapes lower separately
    for precision, segments in [(prec, 2) for prec in fused.PRECISIONS] + [(fused.PRECISION, 1)]:
        loss = lambda xq, xk, v: jnp.sum(fused.attend(xq, r, p, c, xk, r, p, c, v, jnp.ones((b, l), bool), causal,
                                                      interpret=False, segments=segments, precision=precision)[0])
        text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(x, x, v).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text.lower()
    # the document kernels (runs), both modes
    runs = jnp.asarray(np.repeat(np.arange(4), l // 4)[None], jnp.int32)
    loss = lambda xq, xk, v: jnp.sum(fused.attend(xq, r, p, c, xk, r, p, c, v, jnp.ones((b, l), bool), causal,
                                                  interpret=False, runs=runs)[0])
    text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(x, x, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
    for precision in fused.PRECISIONS:
        jax.jit(lambda xk, v: fused.prefill(xk, r, p, c, v, None, interpret=False, precision=precision)).trace(
            x, v).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("causal", [False, True])
def test_calls_are_cut_as_the_tuning_table_says(causal):
    """Each (mode, precision) of fused.TUNING cuts a call into its feature blocks and chunks (the grid's
    third axis; a causal call's per-chunk references [B, H, L / chunk, F']), in shapes Triton's products
    take (powers of two from 16)."""
    b, h, l, d, f = 1, 2, 256, 16, 96
    x, r, v = jnp.ones((b, h, l, d)), jnp.zeros((b, h, l)), jnp.ones((b, h, l, 16))
    p, c = jnp.ones((h, d, f)), jnp.zeros((h, f))
    for precision in fused.PRECISIONS:
        chunk, block, warps, stages = fused.tuning(causal, precision)
        assert all(n >= 16 and n & (n - 1) == 0 for n in (chunk, block)) and warps in (1, 2, 4, 8) and stages >= 1
        text = str(jax.make_jaxpr(lambda x: fused.attend(x, r, p, c, x, r, p, c, v, None, causal,
                                                         precision=precision, segments=1))(x))
        width = -(-f // block) * block                  # 96 features: 2 blocks of 64, or 3 of 32
        assert f"grid=(1, 2, {width // block}, 1)" in text
        if causal:
            assert f"f32[1,2,{l // chunk},{width}]" in text
    assert set(fused.TUNING) <= {(m, prec) for m in ("causal", "bidirectional") for prec in fused.PRECISIONS}


def test_the_document_reference_is_picked_exactly_by_low_precision_products():
    """A document's reference is its first key's log-features, picked by a product: with the product's
    operands rounded to bf16 (what PRECISIONS["bf16"] does on a GPU, emulated here) the pick is still the
    float32 value to 2⁻²⁴ relative, where one bf16 product would be off by up to 2⁻⁹."""
    rng = np.random.default_rng(40)
    x = jnp.asarray(rng.standard_normal((16, 24)) * 300.0, jnp.float32)
    onehot = jnp.asarray(np.eye(16)[rng.permutation(16)], jnp.float32)
    bf16 = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
    dot = lambda a, b: jnp.dot(bf16(a), bf16(b), precision="highest")
    want = np.asarray(onehot) @ np.asarray(x, np.float64)
    assert np.max(np.abs(np.asarray(fused._pick(dot, onehot, x)) - want)) <= 2.0 ** -23 * np.max(np.abs(want))
    assert np.max(np.abs(np.asarray(dot(onehot, x)) - want)) > 2.0 ** -12 * np.max(np.abs(want))


def test_a_document_pass_continues_from_the_carry_of_the_keys_before_it():
    """The sequence cut at s (inside documents, at a chunk's start, at a document's start, mid-chunk): the
    second part entering with the carry of the first part's last document (favor.attention.documents.
    summary of its keys, as the sequence axis folds them) gives the whole pass's outputs and gradients,
    the gradients reaching the first part's keys through the carry."""
    args, docs = _doc_case(36)
    xq, rq, pq, cq, xk, rk, pk, ck, v = (jnp.asarray(a, jnp.float32) for a in args[:9])
    mask = jnp.asarray(args[9])
    runs = documents.runs(jnp.asarray(docs, jnp.int32))
    cut = (CHUNK16, *fused.tuning(True, fused.PRECISION)[1:])
    l = xq.shape[2]
    w = jnp.asarray(np.random.default_rng(37).standard_normal((2, 2, l, 3)), jnp.float32)
    part = lambda a, lo, hi: a[:, :, lo:hi] if a.ndim >= 3 else a[:, lo:hi]

    def passes(xq, xk, v, s):
        pieces, carry = [], None
        for lo, hi in ((0, s), (s, l)):
            x = [part(a, lo, hi) for a in (xq, rq, xk, rk, v, mask, runs)]
            pieces.append(fused.document_pass(x[0], x[1], pq, cq, x[2], x[3], pk, ck, x[4], x[5], x[6], x[6],
                                              carry=carry, cut=cut)[0])
            lk = jnp.einsum("bhld,hdf->bhlf", x[2], pk) + ck[None, :, None] + x[3][..., None]
            keep = x[5] & (x[6] == x[6][:, -1:])
            carry = documents.summary(jnp.where(x[5][:, None, :, None], lk, -jnp.inf), None,
                                      jnp.concatenate([x[4], jnp.ones_like(x[4][..., :1])], -1), keep, x[6][:, -1])
        return jnp.concatenate(pieces, 2)

    # one program per cut: the outputs (the loss's aux) and the gradients
    loss = lambda out: (jnp.sum(w * out), out)
    run = jax.jit(lambda xq, xk, v, s: jax.value_and_grad(lambda *a: loss(passes(*a, s)), (0, 1, 2), has_aux=True)(
        xq, xk, v), static_argnums=3)
    whole = jax.jit(lambda xq, xk, v: jax.value_and_grad(lambda *a: loss(fused.document_pass(
        a[0], rq, pq, cq, a[1], rk, pk, ck, a[2], mask, runs, runs, cut=cut)[0]), (0, 1, 2), has_aux=True)(xq, xk, v))
    (_, ref), want = whole(xq, xk, v)
    for s in (40, 48, 64, 100):
        (_, out), got = run(xq, xk, v, s)
        for name, a, b in zip(("xq", "xk", "v"), got, want):
            err = float(np.max(np.abs(np.asarray(a - b))) / np.max(np.abs(np.asarray(b))))
            assert err < 1e-5, (s, name, err)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * np.max(np.abs(np.asarray(ref))))


def test_a_bidirectional_call_with_more_queries_than_keys_flags_no_row():
    """Bidirectional attention has no chunk form to exceed: `exceeded` is all False and has one entry per
    query, also where the queries outnumber the keys (Lq = 40, Lk = 9), and the output meets the float64
    reference."""
    args = [np.asarray(a) for a in _log_linear_case(50, l=80)]
    args[0], args[1] = args[0][:, :, :40], args[1][:, :, :40]
    args[4], args[5], args[8] = args[4][:, :, :9], args[5][:, :, :9], args[8][:, :, :9]
    args[9] = np.ones((1, 9), bool)
    args[9][0, 3] = False
    out, exceeded = _attend32(args, False, None)
    assert exceeded.shape == (1, 2, 40) and not bool(jnp.any(exceeded))
    want = _attend64(*args, False)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5 * np.max(np.abs(want)))
