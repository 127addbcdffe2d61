"""The TPU (Mosaic) kernels of favor.attention.tpu, run here in Pallas' TPU interpret mode on CPU: equal to a
float64 reference written here and to the Triton-path kernels (favor.attention.fused in plain interpret mode),
outputs and gradients, with padded keys (a leading run, one in the middle, the end), L not a multiple of the
chunk, F not a multiple of 128 in two feature blocks, bf16 inputs; the future never moves the past, bit for bit;
the exceedance flags; and every kernel lowers for TPUs (jax.export), forward and backward, at a realistic size.

TPU interpret mode compiles slowly (seconds a program) and runs each grid point through host callbacks: the
tests share one jitted program per mode (`_program`) at one small shape, and cut calls into chunks of 16."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor.attention import fused, tpu

CUT = (16, 128)           # chunks of 16 rows, blocks of 128 features
B, H, L, D, F, DV = 2, 1, 37, 8, 200, 5     # L: 3 chunks, the last part padding; F: 2 blocks, the second part padding
LEAD = 20                 # batch 1's leading run of padded keys: its first chunk holds no key at all


def _case(seed, growth=1.5):
    """Random log-linear maps log φ = x·P + c + r with r = −½||x||² (FAVOR+'s form), the norms growing along
    the sequence so the references move from chunk to chunk; keys padded at the end and in the middle (batch 0),
    a leading run of LEAD and one in the middle (batch 1)."""
    rng = np.random.default_rng(seed)
    scale = np.linspace(0.3, growth, L)[None, None, :, None]
    xq, xk = (rng.standard_normal((B, H, L, D)) * scale for _ in range(2))
    p = rng.standard_normal((H, D, F)) * 0.7
    c = rng.standard_normal((H, F)) * 0.3
    v = rng.standard_normal((B, H, L, DV))
    mask = np.ones((B, L), bool)
    mask[0, -3:] = False
    mask[0, 20] = False
    mask[1, :LEAD] = False
    mask[1, 25] = False
    return dict(xq=xq, rq=-0.5 * np.sum(xq ** 2, -1), pq=p, cq=c, xk=xk, rk=-0.5 * np.sum(xk ** 2, -1), pk=p, ck=c,
                v=v, valid=mask)


def _attention64(xq, rq, pq, cq, xk, rk, pk, ck, v, valid, causal):
    """float64 attention over the weights Σ_f exp(l_q(i, f) + l_k(j, f)) (a log-sum-exp over features, then a
    softmax over the keys a row sees); 0 for a row that sees no key."""
    lq = np.einsum("bhld,hdf->bhlf", xq, pq) + cq[None, :, None] + rq[..., None]
    lk = np.einsum("bhld,hdf->bhlf", xk, pk) + ck[None, :, None] + rk[..., None]
    pair = lq[:, :, :, None, :] + lk[:, :, None, :, :]                                  # [B, H, Lq, Lk, F]
    top = np.max(pair, -1)
    logit = top + np.log(np.sum(np.exp(pair - top[..., None]), -1))
    sees = valid[:, None, None, :] & (np.tril(np.ones(logit.shape[2:], bool)) if causal else True)
    logit = np.where(sees, logit, -np.inf)
    peak = np.max(logit, -1, keepdims=True)
    wts = np.where(sees, np.exp(logit - np.where(np.isfinite(peak), peak, 0.0)), 0.0)
    den = np.sum(wts, -1, keepdims=True)
    return np.where(den > 0, (wts @ v) / np.where(den > 0, den, 1.0), 0.0)


DIFF = ("xq", "rq", "xk", "rk", "v")         # the inputs the kernels differentiate


@functools.cache
def _program(module, causal, **opts):
    """One jitted program per (kernels, mode): (Σ w·out, (out, exceeded)) and d/d(xq, rq, xk, rk, v)."""
    def loss(xq, rq, xk, rk, v, params, valid, w):
        out, exceeded = module.attend(xq, rq, params[0], params[1], xk, rk, params[2], params[3], v, valid, causal,
                                      **dict(opts))
        return jnp.sum(w * out), (out, exceeded)
    return jax.jit(jax.value_and_grad(loss, tuple(range(5)), has_aux=True))


def _run(case, causal, w, module=tpu, dtype=jnp.float32, **opts):
    if module is tpu:
        opts = {"cut": CUT, **opts}
    as32 = lambda k: jnp.asarray(case[k], dtype)
    params = tuple(jnp.asarray(case[k], jnp.float32) for k in ("pq", "cq", "pk", "ck"))
    (_, (out, exceeded)), grads = _program(module, causal, **opts)(
        *(as32(k) for k in DIFF), params, jnp.asarray(case["valid"]), jnp.asarray(w, jnp.float32))
    return out, exceeded, dict(zip(DIFF, grads))


def _weights(seed):
    return np.random.default_rng(seed).standard_normal((B, H, L, DV))


@pytest.mark.parametrize("causal", [False, True])
def test_tpu_kernel_equals_the_float64_reference_outputs_and_gradients(causal):
    """Outputs against the float64 reference; d/d(xq, xk, rk, v) of Σ w·out against its central differences
    (ε = 1e-6, random directions); d/drq, 0 in exact arithmetic (a row's constant cancels in its ratio), is
    rounding beside the others."""
    case, w = _case(1), _weights(2)
    want = _attention64(**case, causal=causal)
    out, exceeded, grads = _run(case, causal, w)
    assert not bool(jnp.any(exceeded))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5 * np.max(np.abs(want)))
    assert np.max(np.abs(np.asarray(grads["rq"]))) <= 1e-5 * np.max(np.abs(np.asarray(grads["xq"])))
    rng = np.random.default_rng(3)
    for name in ("xq", "xk", "rk", "v"):
        direction = rng.standard_normal(case[name].shape)
        moved = lambda e: float(np.sum(w * _attention64(**{**case, name: case[name] + e * direction}, causal=causal)))
        fd = (moved(1e-6) - moved(-1e-6)) / 2e-6
        got = float(np.sum(np.asarray(grads[name], np.float64) * direction))
        assert abs(got - fd) <= 2e-4 * (abs(fd) + np.linalg.norm(np.asarray(grads[name])) * 1e-2), (name, got, fd)


@pytest.mark.parametrize("causal", [False, True])
def test_tpu_kernel_equals_the_triton_path_kernels(causal):
    """The same call through fused.attend's kernels (cut their own way: fused.TUNING's chunks and feature blocks)
    in plain Pallas interpret mode: outputs and gradients to float32 rounding."""
    case, w = _case(4), _weights(5)
    out, _, grads = _run(case, causal, w)
    out2, exceeded2, grads2 = _run(case, causal, w, module=fused, interpret=True)
    assert not bool(jnp.any(exceeded2))
    np.testing.assert_allclose(np.asarray(out), np.asarray(out2), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(out2))))
    top = max(float(jnp.max(jnp.abs(g))) for g in grads2.values())
    for name in DIFF:
        a, b = np.asarray(grads[name]), np.asarray(grads2[name])
        # d/drq is rounding (see above): measured against the largest gradient
        bound = 1e-6 * top if name == "rq" else 1e-5 * np.max(np.abs(b))
        assert np.max(np.abs(a - b)) <= bound, (name, np.max(np.abs(a - b)))


@pytest.mark.parametrize("queries,keys", [((5, 18), (0, L)), ((0, L), (16, 25))], ids=["fewer", "more"])
def test_tpu_kernel_attends_as_many_queries_as_it_is_given(queries, keys):
    """Bidirectional, Lq = 13 (one chunk) against Lk = 37 (three), and Lq = 37 against Lk = 9: each side cut
    and padded on its own, one exceedance flag (False) per query."""
    case = _case(12)
    (q0, q1), (k0, k1) = queries, keys
    sub = {**case, "xq": case["xq"][:, :, q0:q1], "rq": case["rq"][:, :, q0:q1], "valid": case["valid"][:, k0:k1],
           **{name: case[name][:, :, k0:k1] for name in ("xk", "rk", "v")}}
    f32 = lambda k: jnp.asarray(sub[k], jnp.float32)
    out, exceeded = jax.jit(lambda *a: tpu.attend(*a, jnp.asarray(sub["valid"]), False, cut=CUT))(
        *(f32(k) for k in ("xq", "rq", "pq", "cq", "xk", "rk", "pk", "ck", "v")))
    want = _attention64(**sub, causal=False)
    assert out.shape == want.shape and exceeded.shape == want.shape[:3] and not bool(jnp.any(exceeded))
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5 * np.max(np.abs(want)))


def test_tpu_kernel_takes_bf16_inputs():
    """bf16 queries, keys and values (the kernel computes in float32): bf16 gradients, outputs and gradients
    those of the float32 call on the rounded inputs (the causal mode: every kernel of it)."""
    case, w = _case(6), _weights(7)
    rounded = {k: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) if k in DIFF else a for k, a in case.items()}
    out, _, grads = _run(case, True, w, dtype=jnp.bfloat16)
    out32, _, grads32 = _run(rounded, True, w)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(out32), rtol=1e-5, atol=1e-5)
    for name in DIFF:
        assert grads[name].dtype == jnp.bfloat16
        a, b = np.asarray(grads[name], np.float64), np.asarray(grads32[name], np.float64)
        assert np.max(np.abs(a - b)) <= 1e-2 * np.max(np.abs(b)) + 1e-6, (name, np.max(np.abs(a - b)))


def test_tpu_kernel_keeps_the_future_from_the_past_bit_for_bit():
    """Causal: tokens from t on replaced (queries, keys, values; t inside a chunk and at a chunk's start):
    the outputs before t are the same float32s, and so is every gradient reaching the inputs before t from the
    outputs before t."""
    case, other = _case(8), _case(9)
    w = _weights(10)
    for t in (16, 21):
        wt = np.where(np.arange(L)[None, None, :, None] < t, w, 0.0)
        mixed = dict(case)
        for k in DIFF:
            mixed[k] = case[k].copy()
            mixed[k][:, :, t:] = other[k][:, :, t:]
        (o1, _, g1), (o2, _, g2) = _run(case, True, wt), _run(mixed, True, wt)
        np.testing.assert_array_equal(np.asarray(o1)[:, :, :t], np.asarray(o2)[:, :, :t])
        for name in DIFF:
            np.testing.assert_array_equal(np.asarray(g1[name])[:, :, :t], np.asarray(g2[name])[:, :, :t])


def test_tpu_kernel_flags_the_rows_after_a_key_beyond_the_bound():
    """FAVOR+ maps (ω ~ N(0, 1), inputs scaled by D^-1/4): keys all one direction of norm 5·√D (inside the
    bound), and the same with one ordinary key (N(0, 1) entries) at t in batch 0, head 0, whose log-features
    exceed its chunk's reference by far more than EXCEEDANCE. Only that batch and head's rows from t on are
    flagged; every other row is bit for bit the call's without the key."""
    rng = np.random.default_rng(11)
    b, h, l, d, f, t = 2, 2, 40, 16, 100, 21
    s = d ** -0.25
    q = rng.standard_normal((b, h, l, d)) * s
    unit = rng.standard_normal(d)
    k = np.broadcast_to(unit / np.linalg.norm(unit) * 5 * d ** 0.5 * s, (b, h, l, d)).copy()
    moved = k.copy()
    moved[0, 0, t] = rng.standard_normal(d) * s
    omega = jnp.asarray(rng.standard_normal((h, d, f)), jnp.float32)
    const = jnp.full((h, f), -0.5 * np.log(f), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, h, l, 4)), jnp.float32)
    half_sq = lambda x: jnp.asarray(-0.5 * np.sum(x ** 2, -1), jnp.float32)
    run = jax.jit(lambda xq, rq, xk, rk: tpu.attend(xq, rq, omega, const, xk, rk, omega, const, v, None, True, cut=CUT))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    base, flags = run(f32(q), half_sq(q), f32(k), half_sq(k))
    out, flags2 = run(f32(q), half_sq(q), f32(moved), half_sq(moved))
    assert not bool(jnp.any(flags))
    want = np.zeros((b, h, l), bool)
    want[0, 0, t:] = True
    np.testing.assert_array_equal(np.asarray(flags2), want)
    base, out = np.asarray(base), np.asarray(out)
    np.testing.assert_array_equal(out[0, 0, :t], base[0, 0, :t])
    np.testing.assert_array_equal(out[0, 1], base[0, 1])
    np.testing.assert_array_equal(out[1], base[1])
    assert np.all(np.isfinite(out))


def test_tpu_kernel_padded_features_never_set_a_keys_scale():
    """A map whose row term jumps by 50 between keys while every real log-feature stays 0 (D = 1, F = 24, padded
    to 128): the padded features' l_k − τ0 is that jump, which must not count as a key beyond the bound."""
    l, f = 8, 24
    xk = np.zeros((1, 1, l, 1), np.float32)
    xk[0, 0, 0, 0] = 50.0
    rk = np.zeros((1, 1, l), np.float32)
    rk[0, 0, 0] = -50.0                                 # l_k(j, f) = 0 for every key and real feature
    ones, zeros = np.ones((1, f), np.float32), np.zeros((f,), np.float32)
    v = np.arange(l, dtype=np.float32).reshape(1, 1, l, 1)
    out, exceeded = tpu.attend(jnp.zeros((1, 1, l, 1)), jnp.zeros((1, 1, l)), ones, zeros, xk, rk, ones, zeros, v,
                               None, True, cut=(8, 128))
    assert not bool(jnp.any(exceeded))
    np.testing.assert_allclose(np.asarray(out)[0, 0, :, 0], np.arange(l) / 2.0, rtol=1e-6)   # mean of v_0..v_i


def test_tpu_kernel_refuses_what_it_does_not_cover():
    x, r, p, c = jnp.zeros((1, 1, 16, 4)), jnp.zeros((1, 1, 16)), jnp.zeros((4, 8)), jnp.zeros((8,))
    with pytest.raises(ValueError, match="Lq = Lk"):
        tpu.attend(x, r, p, c, x[:, :, :8], r[:, :, :8], p, c, x[:, :, :8], None, True)
    with pytest.raises(ValueError, match="chunks"):
        tpu.attend(x, r, p, c, x, r, p, c, x, None, False, cut=(12, 128))
    with pytest.raises(ValueError, match="precision"):
        tpu.attend(x, r, p, c, x, r, p, c, x, None, False, precision="tf32")


@pytest.mark.parametrize("causal", [False, True])
def test_tpu_kernels_lower_for_tpus(causal):
    """Every kernel lowers through Mosaic for a TPU (jax.export with platforms=["tpu"]; no TPU needed): the
    forward pass and value_and_grad at B = 1, H = 2, L = 1024, D = Dv = 64, F = 256, the default cut, float32
    inputs with float32-level products and bf16 inputs with bf16 products. The lowering checks every block's
    tiling ((8, 128) or the whole dims) and every operation Mosaic lowers; a block it cannot tile fails here."""
    b, h, l, d, f = 1, 2, 1024, 64, 256
    for dtype, precision in ((jnp.float32, None), (jnp.bfloat16, "bf16")):
        def f_and_grads(xq, rq, xk, rk, v, p, c):
            def loss(xq, rq, xk, rk, v):
                out, exceeded = tpu.attend(xq, rq, p, c, xk, rk, p, c, v, None, causal, interpret=False,
                                           precision=precision)
                return jnp.sum(out), exceeded
            return jax.value_and_grad(loss, tuple(range(5)), has_aux=True)(xq, rq, xk, rk, v)

        rows = jax.ShapeDtypeStruct((b, h, l, d), dtype)
        row = jax.ShapeDtypeStruct((b, h, l), jnp.float32)
        shapes = (rows, row, rows, row, rows, jax.ShapeDtypeStruct((h, d, f), jnp.float32),
                  jax.ShapeDtypeStruct((h, f), jnp.float32))
        exported = jax.export.export(jax.jit(f_and_grads), platforms=["tpu"])(*shapes)
        text = exported.mlir_module()
        kernels = 3 if causal else 4          # forward (+ key state) and the two backward kernels
        assert text.count("tpu_custom_call") >= kernels, text.count("tpu_custom_call")


def test_impl_pallas_on_a_tpu_runs_the_tpu_kernels(monkeypatch):
    """With the kernels' backend a TPU (replaced here; the Mosaic kernels then run in TPU interpret mode on this
    CPU), impl='pallas' runs favor.attention.tpu and gives favor's XLA pass, and the calls the TPU kernels do
    not cover yet (packed documents, the sequence axis) are one line naming impl='auto'; 'auto' stays on XLA
    (no TPU measurement in AUTO_FUSED), and a prompt's prefill runs on XLA."""
    from favor import attention
    from favor.attention import kinds
    monkeypatch.setattr(kinds, "kernel_backend", lambda: "tpu")
    calls = []
    traced = tpu.attend
    monkeypatch.setattr(tpu, "attend", lambda *a, **kw: calls.append(1) or traced(*a, **kw))
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 24, 1, 8)) * 0.5, jnp.float32) for _ in range(3))
    kernel, xla = (attention.get("favor+", num_features=32, impl=impl, redraw="fixed") for impl in ("pallas", "xla"))
    for causal in (False, True):
        got = jax.jit(lambda q, k, v: kernel(q, k, v, causal=causal))(q, k, v)
        np.testing.assert_allclose(np.asarray(got), np.asarray(xla(q, k, v, causal=causal)), rtol=2e-5, atol=2e-6)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="^favor\\+: impl='pallas' on a TPU runs calls without segment_ids .* "
                                         "impl='auto' or 'xla' runs it on XLA$"):
        kernel(q, k, v, causal=True, segment_ids=jnp.zeros((1, 24), jnp.int32))
    with pytest.raises(ValueError, match="on a TPU runs calls without the sequence mesh axis"):
        kernel.sequence_fused()
    assert not attention.get("favor+", num_features=32).uses_fused(True, q, k)
    ctx = kernel.decode_context(8)
    state = kernel.decode_prefill(k, v, ctx)
    want = xla.decode_prefill(k, v, ctx)
    for name in ("tau", "sum"):
        np.testing.assert_allclose(np.asarray(state[name]), np.asarray(want[name]), rtol=1e-6, atol=1e-6)
    assert len(calls) == 2
