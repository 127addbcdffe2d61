"""The TPU (Mosaic) kernels of favor.attention.tpu, run here in Pallas' TPU interpret mode on CPU: equal to a
float64 reference written here and to the Triton-path kernels (favor.attention.fused in plain interpret mode),
outputs and gradients, with padded keys (a leading run, one in the middle, the end), L not a multiple of the
chunk, F not a multiple of 128 in two feature blocks, bf16 inputs; the future never moves the past, bit for bit;
the exceedance flags; and every kernel lowers for TPUs (jax.export), forward and backward, at a realistic size.
The same for the packed-documents pass (`document_pass`: documents through chunks, an entering carry, the
log-denominator and its cotangent, other documents never moved) and the prefill.

TPU interpret mode compiles slowly (seconds a program) and runs each grid point through host callbacks: the
tests share one jitted program per mode (`_program`) at one small shape, and cut calls into chunks of 16."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor.attention import documents, fused, linear, tpu

CUT = (16, 128)           # chunks of 16 rows, blocks of 128 features
B, H, L, D, F, DV = 2, 1, 37, 8, 200, 5     # L: 3 chunks, the last part padding; F: 2 blocks, the second part padding
LEAD = 20                 # batch 1's leading run of padded keys: its first chunk holds no key at all


def _maps(rng, shape, growth, spread):
    """Random log-linear maps log φ = x·P + c + r with r = −½||x||² (FAVOR+'s form) over `shape` (B, H, L, D),
    the norms growing along the sequence to `growth` so the references move from chunk to chunk; P's entries
    of scale `spread`, values [B, H, L, DV] and every key valid."""
    b, h, l, d = shape
    scale = np.linspace(0.3, growth, l)[None, None, :, None]
    xq, xk = (rng.standard_normal(shape) * scale for _ in range(2))
    p = rng.standard_normal((h, d, F)) * spread
    c = rng.standard_normal((h, F)) * 0.3
    v = rng.standard_normal((b, h, l, DV))
    return dict(xq=xq, rq=-0.5 * np.sum(xq ** 2, -1), pq=p, cq=c, xk=xk, rk=-0.5 * np.sum(xk ** 2, -1), pk=p, ck=c,
                v=v, valid=np.ones((b, l), bool))


def _case(seed, growth=1.5):
    """`_maps` at B, H, L, D; keys padded at the end and in the middle (batch 0), a leading run of LEAD and one
    in the middle (batch 1)."""
    case = _maps(np.random.default_rng(seed), (B, H, L, D), growth, 0.7)
    mask = case["valid"]
    mask[0, -3:] = False
    mask[0, 20] = False
    mask[1, :LEAD] = False
    mask[1, 25] = False
    return case


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


def test_tpu_kernel_refuses_what_it_does_not_cover():
    x, r, p, c = jnp.zeros((1, 1, 16, 4)), jnp.zeros((1, 1, 16)), jnp.zeros((4, 8)), jnp.zeros((8,))
    with pytest.raises(ValueError, match="Lq = Lk"):
        tpu.attend(x, r, p, c, x[:, :, :8], r[:, :, :8], p, c, x[:, :, :8], None, True)
    with pytest.raises(ValueError, match="chunks"):
        tpu.attend(x, r, p, c, x, r, p, c, x, None, False, cut=(12, 128))
    with pytest.raises(ValueError, match="precision"):
        tpu.attend(x, r, p, c, x, r, p, c, x, None, False, precision="tf32")


def test_tpu_kernel_pads_features_to_whole_lanes_only():
    """The feature block is the widest of whole lanes, up to the tuned one, that divides F's lanes: no feature
    beyond F rounded up to 128 is computed (F = 384 in three blocks of 128, not 512 in two of 256)."""
    tuned = tpu.TUNING["causal"][1]
    for f in (1, 48, 128, 200, 256, 384, 640, 1024):
        block = tpu._plan("causal", 1024, f, True, None, None).block
        lanes = -(-f // tpu.LANES) * tpu.LANES
        assert lanes % block == 0 and block % tpu.LANES == 0 and block <= tuned, (f, block)
        assert block == tuned or lanes % tuned, (f, block)          # the tuned block wherever it divides


def _lowered(fn, *shapes):
    """The MLIR of jit(fn) exported for TPUs at `shapes` (jax.export with platforms=["tpu"]; no TPU needed)."""
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*shapes).mlir_module()


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
        text = _lowered(f_and_grads, *shapes)
        kernels = 3 if causal else 4          # forward (+ key state) and the two backward kernels
        assert text.count("tpu_custom_call") >= kernels, text.count("tpu_custom_call")


def test_tpu_document_pass_and_prefill_lower_for_tpus():
    """The document kernels and the prefill lower through Mosaic for a TPU (as above, same sizes): document_pass
    forward, and value_and_grad in xq, xk, v and the carry's T (Σ out + Σ lden: the log-denominator's cotangent
    too), entering with a carry; prefill; float32 inputs with float32-level products and bf16 with bf16 ones."""
    b, h, l, d, f = 1, 2, 1024, 64, 256
    struct = jax.ShapeDtypeStruct
    for dtype, precision in ((jnp.float32, None), (jnp.bfloat16, "bf16")):
        rows, row = struct((b, h, l, d), dtype), struct((b, h, l), jnp.float32)
        p, c = struct((h, d, f), jnp.float32), struct((h, f), jnp.float32)
        runs, valid = struct((b, l), jnp.int32), struct((b, l), jnp.bool_)
        carry = (struct((b, h), jnp.bool_), struct((b, h, f), jnp.float32), struct((b, h, f, d + 1), jnp.float32),
                 struct((b,), jnp.int32))
        one = functools.partial(tpu.document_pass, interpret=False, precision=precision)

        def forward(xq, rq, xk, rk, v, p, c, valid, runs, carry):
            return one(xq, rq, p, c, xk, rk, p, c, v, valid, runs, runs, carry=carry)

        def f_and_grads(xq, rq, xk, rk, v, p, c, valid, runs, carry):
            seen, tau, t, run = carry

            def loss(xq, xk, v, t):
                out, lden, exceeded = one(xq, rq, p, c, xk, rk, p, c, v, valid, runs, runs, carry=(seen, tau, t, run))
                return jnp.sum(out) + jnp.sum(jnp.where(lden > 0.5 * fused.LOW, lden, 0.0)), exceeded
            return jax.value_and_grad(loss, tuple(range(4)), has_aux=True)(xq, xk, v, t)

        shapes = (rows, row, rows, row, rows, p, c, valid, runs, carry)
        assert _lowered(forward, *shapes).count("tpu_custom_call") == 1
        assert _lowered(f_and_grads, *shapes).count("tpu_custom_call") == 3        # forward, ∂q, ∂k
        prefill = lambda xk, rk, v, p, c: tpu.prefill(xk, rk, p, c, v, None, interpret=False, precision=precision)
        assert _lowered(prefill, rows, row, rows, p, c).count("tpu_custom_call") == 1


def test_impl_pallas_on_a_tpu_runs_the_tpu_kernels(monkeypatch):
    """With the kernels' backend a TPU (replaced here; the Mosaic kernels then run in TPU interpret mode on this
    CPU), impl='pallas' runs favor.attention.tpu for plain calls, packed documents (both modes) and a prompt's
    prefill, and gives favor's XLA pass; 'auto' stays on XLA (no TPU measurement in AUTO_FUSED)."""
    from favor import attention
    from favor.attention import kinds
    monkeypatch.setattr(kinds, "kernel_backend", lambda: "tpu")
    calls = {"attend": 0, "document_pass": 0, "prefill": 0}

    def counted(name):
        traced = getattr(tpu, name)
        return lambda *a, **kw: calls.__setitem__(name, calls[name] + 1) or traced(*a, **kw)

    for name in calls:
        monkeypatch.setattr(tpu, name, counted(name))
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 24, 1, 8)) * 0.5, jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.repeat([0, 1, 2], [9, 10, 5])[None], jnp.int32)
    kernel, xla = (attention.get("favor+", num_features=32, impl=impl, redraw="fixed") for impl in ("pallas", "xla"))
    for causal in (False, True):
        for ids in (None, seg):
            got = jax.jit(lambda q, k, v: kernel(q, k, v, causal=causal, segment_ids=ids))(q, k, v)
            want = xla(q, k, v, causal=causal, segment_ids=ids)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    # documents: one pass causal, two bidirectional (the reversed sequence's)
    assert calls == {"attend": 2, "document_pass": 3, "prefill": 0}, calls
    assert kernel.sequence_fused()
    assert not attention.get("favor+", num_features=32).uses_fused(True, q, k)
    ctx = kernel.decode_context(8)
    state = kernel.decode_prefill(k, v, ctx)
    want = xla.decode_prefill(k, v, ctx)
    for name in ("tau", "sum"):
        np.testing.assert_allclose(np.asarray(state[name]), np.asarray(want[name]), rtol=1e-6, atol=1e-6)
    assert calls["prefill"] == 1


# -- packed documents (document_pass) and prefill ---------------------------------------------------------
# Documents over DL = 45 tokens in chunks of 16 (3 chunks, the last part padding): batch 0 starts them at 0, 5,
# 12 (through all three chunks, a padded key at 20), 40 (one token) and 41 (its last two keys padded); batch 1 at
# 0 (its first 7 keys padded), 16 (a chunk's start) and 30 (a padded key at 33, the last three padded).
DB, DH, DL, DD = 2, 2, 45, 16
DOC_STARTS = ((0, 5, 12, 40, 41), (0, 16, 30))
DOC_DIFF = ("xq", "rq", "xk", "rk", "v", "t")       # t: the entering carry's T


def _ids(starts, l):
    ids = np.zeros((len(starts), l), np.int32)
    for b, row in enumerate(starts):
        for i, s in enumerate(row):
            ids[b, s:] = i
    return ids


def _doc_case(seed, l=DL, starts=DOC_STARTS, growth=1.2):
    """`_case`'s maps at DB, DH, l, DD (F = 200: two blocks of 128), the documents `starts`, padding as above
    (for l = DL) and runs [B, l] (documents.runs of the ids)."""
    case = _maps(np.random.default_rng(seed), (DB, DH, l, DD), growth, 0.5)
    mask = case["valid"]
    if l == DL:
        mask[0, [20, 43, 44]] = False
        mask[1, :7] = False
        mask[1, [33, 42, 43, 44]] = False
    runs = np.asarray(documents.runs(jnp.asarray(_ids(starts, l))))
    return dict(case, qrun=runs, krun=runs)


def _no_carry(b=DB, h=DH, f=F, dv=DV):
    """A carry that holds no key (as None: nothing read, nothing carried on)."""
    return dict(seen=np.zeros((b, h), bool), tau=np.zeros((b, h, f)), t=np.zeros((b, h, f, dv + 1)),
                run=np.full((b,), linear.NO_RUN, np.int32))


def _summary64(case, keep, run):
    """The carry the keys `keep` [B, L] of `case` leave (documents.summary in float64): seen, τ = their
    per-feature maximum, T = Σ exp(l_k − τ)[v, 1], and `run` [B]."""
    lk = np.where(keep[:, None, :, None], _logs64(case)[1], -np.inf)
    top = np.max(lk, axis=2)
    tau = np.where(np.isfinite(top), top, 0.0)
    fk = np.where(keep[:, None, :, None], np.exp(lk - tau[:, :, None]), 0.0)
    v1 = np.concatenate([case["v"], np.ones_like(case["v"][..., :1])], -1)
    return dict(seen=np.any(np.isfinite(top), -1), tau=tau, t=np.einsum("bhlf,bhld->bhfd", fk, v1), run=run)


def _logs64(case):
    lq = np.einsum("bhld,hdf->bhlf", case["xq"], case["pq"]) + case["cq"][None, :, None] + case["rq"][..., None]
    lk = np.einsum("bhld,hdf->bhlf", case["xk"], case["pk"]) + case["ck"][None, :, None] + case["rk"][..., None]
    return lq, lk


def _documents64(case, carry=None):
    """float64 causal attention with documents: query i over the valid keys j ≤ i with krun_j = qrun_i (weights
    Σ_f exp(l_q(i, f) + l_k(j, f))) and, if its run is the carry's and the carry holds keys, the carry's
    (Σ_f exp(l_q(i, f) + τ_f) T_f). (out, log-denominator: −inf where no key)."""
    lq, lk = _logs64(case)
    pair = lq[:, :, :, None, :] + lk[:, :, None, :, :]                                  # [B, H, L, L, F]
    top = np.max(pair, -1)
    logit = top + np.log(np.sum(np.exp(pair - top[..., None]), -1))
    l = logit.shape[2]
    sees = (case["valid"][:, None, None, :] & np.tril(np.ones((l, l), bool))
            & (case["qrun"][:, None, :, None] == case["krun"][:, None, None, :]))
    logit = np.where(sees, logit, -np.inf)
    carry = carry or _no_carry(*lq.shape[:2], lq.shape[3], case["v"].shape[-1])
    reads = carry["seen"][:, :, None] & (case["qrun"] == carry["run"][:, None])[:, None]          # [B, H, L]
    held = np.where(reads[..., None], lq + carry["tau"][:, :, None], -np.inf)                   # [B, H, L, F]
    peak = np.maximum(np.max(logit, -1), np.max(held, -1))
    shift = np.where(np.isfinite(peak), peak, 0.0)[..., None]
    wts, wc = np.exp(logit - shift), np.exp(held - shift)
    num = wts @ case["v"] + np.einsum("bhlf,bhfd->bhld", wc, carry["t"][..., :-1])
    den = np.sum(wts, -1) + np.einsum("bhlf,bhf->bhl", wc, carry["t"][..., -1])
    out = np.where(den[..., None] > 0, num / np.where(den > 0, den, 1.0)[..., None], 0.0)
    return out, np.where(den > 0, shift[..., 0] + np.log(np.where(den > 0, den, 1.0)), -np.inf)


def _known(lden):
    """The log-denominator where a row has a key (0 elsewhere: the loss takes no LOW there)."""
    return jnp.where(lden > 0.5 * fused.LOW, lden, 0.0)


@functools.cache
def _doc_program(module, carried, **opts):
    """One jitted program per kernels: (Σ w·out + Σ u·lden, (out, lden, exceeded)) and d/d(xq, rq, xk, rk, v, the
    carry's T); not `carried`: the pass takes carry=None (and T no gradient)."""
    def loss(xq, rq, xk, rk, v, t, params, valid, runs, carry, w, u):
        seen, tau, run = carry
        out, lden, exceeded = module.document_pass(xq, rq, params[0], params[1], xk, rk, params[2], params[3], v,
                                                   valid, runs[0], runs[1], carry=(seen, tau, t, run) if carried
                                                   else None, **dict(opts))
        return jnp.sum(w * out) + jnp.sum(u * _known(lden)), (out, lden, exceeded)
    return jax.jit(jax.value_and_grad(loss, tuple(range(6)), has_aux=True))


def _run_docs(case, carry, w, u, module=tpu, dtype=jnp.float32, **opts):
    """(out, lden, exceeded, gradients by DOC_DIFF name) of the pass over `case` entering with `carry` (None: no
    carry)."""
    if module is tpu:
        opts = {"cut": CUT, **opts}
    carried, carry = carry is not None, carry or _no_carry()
    cast = lambda a: jnp.asarray(a, dtype)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    params = tuple(f32(case[k]) for k in ("pq", "cq", "pk", "ck"))
    runs = tuple(jnp.asarray(case[k], jnp.int32) for k in ("qrun", "krun"))
    (_, (out, lden, exceeded)), grads = _doc_program(module, carried, **opts)(
        *(cast(case[k]) for k in DOC_DIFF[:5]), f32(carry["t"]), params, jnp.asarray(case["valid"]), runs,
        (jnp.asarray(carry["seen"]), f32(carry["tau"]), jnp.asarray(carry["run"], jnp.int32)), f32(w), f32(u))
    return out, lden, exceeded, dict(zip(DOC_DIFF, grads))


def _doc_weights(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((DB, DH, DL, DV)), rng.standard_normal((DB, DH, DL))


def _assert_equals_reference(out, lden, want, want_lden, tol=2e-5):
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol * np.max(np.abs(want)))
    known = np.isfinite(want_lden)
    np.testing.assert_allclose(np.asarray(lden, np.float64)[known], want_lden[known], rtol=tol, atol=tol)
    assert np.all(np.asarray(lden)[~known] == fused.LOW)


def _loss64(case, carry, w, u):
    out, lden = _documents64(case, carry)
    return float(np.sum(w * out) + np.sum(u * np.where(np.isfinite(lden), lden, 0.0)))


def _assert_central_differences(case, carry, w, u, grads, names, seed):
    """d/d(names) of Σ w·out + Σ u·lden against the float64 reference's central differences (ε = 1e-6) along
    random directions."""
    rng = np.random.default_rng(seed)
    for name in names:
        in_carry = name == "t"
        source = carry if in_carry else case
        direction = rng.standard_normal(source[name].shape)

        def moved(e):
            shifted = {**source, name: source[name] + e * direction}
            return _loss64(case, shifted, w, u) if in_carry else _loss64(shifted, carry, w, u)
        fd = (moved(1e-6) - moved(-1e-6)) / 2e-6
        got = float(np.sum(np.asarray(grads[name], np.float64) * direction))
        assert abs(got - fd) <= 2e-4 * (abs(fd) + np.linalg.norm(np.asarray(grads[name])) * 1e-2), (name, got, fd)


def test_tpu_document_pass_equals_the_float64_reference_outputs_and_gradients():
    """Several documents per row, one through all three chunks, padding inside and at the end, no carry: outputs
    and log-denominators (LOW where a row sees no key) against the float64 reference, and d/d(xq, rq, xk, rk, v)
    of Σ w·out + Σ u·lden against its central differences (rq reaches the loss through lden alone)."""
    case, (w, u) = _doc_case(20), _doc_weights(21)
    want, want_lden = _documents64(case)
    out, lden, exceeded, grads = _run_docs(case, _no_carry(), w, u)
    assert not bool(jnp.any(exceeded))
    _assert_equals_reference(out, lden, want, want_lden)
    _assert_central_differences(case, _no_carry(), w, u, grads, DOC_DIFF[:5], 22)


P = 9       # the keys before the sequence (the carry's)


def _carried_case(seed):
    """(the sequence, the carry of the P keys before it, the whole P + DL tokens): in batch 0 the first document
    continues the carried one (a padded key among the carried keys), in batch 1 the carried document ends at the
    sequence's start."""
    case = _doc_case(seed)
    before = _doc_case(seed + 1, l=P, starts=((0, 4), (0, 6)))
    before.update(pq=case["pq"], cq=case["cq"], pk=case["pk"], ck=case["ck"])
    before["valid"][0, 6] = False
    ids = np.concatenate([_ids(((0, 4), (0, 6)), P), _ids(DOC_STARTS, DL) + np.array([[1], [2]])], axis=1)
    joined = lambda a, b: np.concatenate([a, b], axis=1 if a.ndim == 2 else 2)
    whole = {k: case[k] if k in ("pq", "cq", "pk", "ck") else joined(before[k], case[k]) for k in case}
    runs = np.asarray(documents.runs(jnp.asarray(ids)))
    whole.update(qrun=runs, krun=runs)
    case.update(qrun=runs[:, P:], krun=runs[:, P:])
    last = runs[:, P - 1]
    carry = _summary64(before, before["valid"] & (runs[:, :P] == last[:, None]), last)
    return case, carry, whole


def test_tpu_document_pass_continues_from_a_carry():
    """The sequence entering with the carry of the keys before it (favor.attention.documents.summary's form, built
    in float64): batch 0, whose first document continues the carried one, gets the float64 reference over the
    whole P + DL tokens (outputs, log-denominators); batch 1, whose carried document ends before the sequence,
    gets bit for bit what it gets with no carry; d/dT of Σ w·out + Σ u·lden meets its central differences."""
    case, carry, whole = _carried_case(23)
    assert carry["run"][0] == case["qrun"][0, 0] and carry["run"][1] != case["qrun"][1, 0]
    assert np.all(carry["seen"])
    w, u = _doc_weights(24)
    out, lden, _, grads = _run_docs(case, carry, w, u)
    want, want_lden = _documents64(whole)
    _assert_equals_reference(out[:1], lden[:1], want[:1, :, P:], want_lden[:1, :, P:])
    bare, bare_lden, _, _ = _run_docs(case, _no_carry(), w, u)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(bare[1]))
    np.testing.assert_array_equal(np.asarray(lden[1]), np.asarray(bare_lden[1]))
    assert np.max(np.abs(np.asarray(out[0] - bare[0]))) > 1e-2         # batch 0 did read the carry
    assert np.all(np.asarray(grads["t"])[1] == 0)
    _assert_central_differences(case, carry, w, u, grads, ("t",), 25)


@pytest.mark.parametrize("module", [tpu, fused], ids=["tpu", "triton-path"])
def test_tpu_document_pass_takes_a_carry_stated_on_a_higher_tau(module):
    """The carry's sums restated on τ + log 1000 (T / 1000: the same keys, z_f < 1, not what documents.summary
    gives), batch 0's first keys padded so that its first rows read the carry alone: outputs and log-denominators
    meet the float64 reference, and d/d(xq, rq, T) its central differences (a kernel that took the carry's τ as a
    bound on its keys clamps those rows' ratio and gets these gradients wrong while the outputs stay right)."""
    case, carry, _ = _carried_case(23)
    case["valid"][0, :5] = False
    restated = {**carry, "tau": carry["tau"] + np.log(1000.0), "t": carry["t"] / 1000.0}
    w, u = _doc_weights(24)
    out, lden, _, grads = _run_docs(case, restated, w, u, module=module,
                                    **({} if module is tpu else {"interpret": True}))
    want, want_lden = _documents64(case, restated)
    _assert_equals_reference(out, lden, want, want_lden)
    _assert_central_differences(case, restated, w, u, grads, ("xq", "rq", "t"), 28)


@pytest.mark.parametrize("keys", ["own", "shifted"])
def test_tpu_document_pass_equals_the_triton_path_kernel(keys):
    """The same pass through fused.document_pass (its own cut; plain Pallas interpret mode), entering with a carry:
    outputs, log-denominators and exceedance flags, and d/d(xq, rq, xk, rk, v, T) of Σ w·out + Σ u·lden, to float32
    rounding. "shifted": the key runs one slot later than the query runs, as the reversed pass of a bidirectional
    call has them (a query then sees no key at its document's start)."""
    case, carry, _ = _carried_case(26)
    if keys == "shifted":
        case["krun"] = np.asarray(documents.shifted_runs(jnp.asarray(case["krun"]), 1))
    w, u = _doc_weights(27)
    out, lden, exceeded, grads = _run_docs(case, carry, w, u)
    out2, lden2, exceeded2, grads2 = _run_docs(case, carry, w, u, module=fused, interpret=True)
    assert not bool(jnp.any(exceeded2))
    np.testing.assert_array_equal(np.asarray(exceeded), np.asarray(exceeded2))
    np.testing.assert_allclose(np.asarray(out), np.asarray(out2), rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(out2))))
    np.testing.assert_allclose(np.asarray(lden), np.asarray(lden2), rtol=1e-6, atol=1e-6)
    for name in DOC_DIFF:
        a, b = np.asarray(grads[name]), np.asarray(grads2[name])
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), (name, np.max(np.abs(a - b)) / np.max(np.abs(b)))
    if keys == "shifted":
        want, want_lden = _documents64(case, carry)
        _assert_equals_reference(out, lden, want, want_lden)


def test_tpu_document_pass_keeps_the_future_and_other_documents_out_bit_for_bit():
    """Tokens from t on replaced (queries, keys, values), t per batch and head: 16 (a chunk's start inside a
    document), 41 (a document's start after the one-token document), 30 (a document's start inside a chunk), 21
    (inside a document inside a chunk): the outputs and log-denominators before t are the same float32s, and so is
    every gradient reaching the inputs before t from the rows before t. Batch 0's document [12, 40) replaced
    (through three chunks): every other row, and every gradient reaching another document's inputs, the same."""
    case, other = _doc_case(28), _doc_case(29)
    w, u = _doc_weights(30)
    before = np.arange(DL) < np.array([[16, 41], [30, 21]])[..., None]          # [B, H, L]
    w, u = w * before[..., None], u * before
    rows = lambda a, mask: mask[..., None] if a.ndim == 4 else mask
    mixed = {**case, **{k: np.where(rows(case[k], before), case[k], other[k]) for k in DOC_DIFF[:5]}}
    document = np.zeros((DB, DH, DL), bool)
    document[0, :, 12:40] = True
    replaced = {**case, **{k: np.where(rows(case[k], document), other[k], case[k]) for k in DOC_DIFF[:5]}}
    base, moved, swapped = (_run_docs(c, _no_carry(), w, u) for c in (case, mixed, replaced))
    for got, keep in ((moved, before), (swapped, ~document)):
        for a, b in zip(base[:2], got[:2]):
            np.testing.assert_array_equal(np.asarray(a)[keep], np.asarray(b)[keep])
        for name in DOC_DIFF[:5]:
            np.testing.assert_array_equal(np.asarray(base[3][name])[keep], np.asarray(got[3][name])[keep], name)
    assert np.max(np.abs(np.asarray(swapped[0] - base[0]))) > 1e-2


def test_tpu_document_pass_takes_bf16_inputs():
    """bf16 queries, keys and values, no carry (carry=None): bf16 gradients, float32 outputs; outputs,
    log-denominators and gradients those of the float32 call on the rounded inputs entering with the empty carry,
    and outputs the float64 reference's (on the unrounded inputs) at bf16's resolution."""
    case, (w, u) = _doc_case(31), _doc_weights(32)
    rounded = {k: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) if k in DOC_DIFF else a for k, a in case.items()}
    out, lden, _, grads = _run_docs(case, None, w, u, dtype=jnp.bfloat16)
    out32, lden32, _, grads32 = _run_docs(rounded, _no_carry(), w, u)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(out32), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lden), np.asarray(lden32), rtol=1e-5, atol=1e-5)
    for name in DOC_DIFF[:5]:
        assert grads[name].dtype == jnp.bfloat16
        a, b = np.asarray(grads[name], np.float64), np.asarray(grads32[name], np.float64)
        assert np.max(np.abs(a - b)) <= 1e-2 * np.max(np.abs(b)) + 1e-6, (name, np.max(np.abs(a - b)))
    want, want_lden = _documents64(case)
    _assert_equals_reference(out, lden, want, want_lden, tol=3e-2)


def test_tpu_document_pass_flags_the_rows_after_a_key_beyond_the_bound():
    """FAVOR+ maps (ω ~ N(0, 1), inputs scaled by D^-1/4), both batches the same tokens, batch 0's documents and
    padding: keys all one direction of norm 5·√D (inside the bound), and in batch 0, head 0 one ordinary key at
    t = 25 inside the document [12, 40), whose log-features exceed that document's reference by far more than
    EXCEEDANCE. Only that document's rows from t on are flagged (not its rows before t, nor the documents after it
    in the same chunk); every other row is bit for bit batch 1's."""
    rng = np.random.default_rng(33)
    t, s = 25, DD ** -0.25
    case = _doc_case(34)
    for k in ("valid", "qrun", "krun"):
        case[k] = np.repeat(case[k][:1], DB, axis=0)
    unit = rng.standard_normal(DD)
    xq = np.repeat(rng.standard_normal((1, DH, DL, DD)) * s, DB, axis=0)
    xk = np.broadcast_to(unit / np.linalg.norm(unit) * 5 * DD ** 0.5 * s, (DB, DH, DL, DD)).copy()
    xk[0, 0, t] = rng.standard_normal(DD) * s
    omega = rng.standard_normal((DH, DD, F))
    const = np.full((DH, F), -0.5 * np.log(F))
    case.update(xq=xq, rq=-0.5 * np.sum(xq ** 2, -1), xk=xk, rk=-0.5 * np.sum(xk ** 2, -1), pq=omega, cq=const,
                pk=omega, ck=const, v=np.repeat(case["v"][:1], DB, axis=0))
    w, u = _doc_weights(35)
    out, lden, exceeded, _ = _run_docs(case, _no_carry(), w, u)
    want = np.zeros((DB, DH, DL), bool)
    want[0, 0, t:40] = True
    np.testing.assert_array_equal(np.asarray(exceeded), want)
    out, lden = np.asarray(out), np.asarray(lden)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0][~want[0]], out[1][~want[0]])
    np.testing.assert_array_equal(lden[0][~want[0]], lden[1][~want[0]])


def test_tpu_prefill_equals_the_triton_path_and_the_float64_state():
    """prefill of the documents case's keys (padding inside and at the end; batch 1's keys all padded): τ and
    Σ exp(l_k − τ)[v, 1] those of fused.prefill and of float64 (τ −inf and the sum 0 where no valid key)."""
    case = _doc_case(36)
    case["valid"][1] = False
    want = _summary64(case, case["valid"], None)
    f32 = lambda k: jnp.asarray(case[k], jnp.float32)
    args = (f32("xk"), f32("rk"), f32("pk"), f32("ck"), f32("v"), jnp.asarray(case["valid"]))
    tau, total = jax.jit(lambda *a: tpu.prefill(*a, cut=CUT))(*args)
    tau2, total2 = jax.jit(lambda *a: fused.prefill(*a, interpret=True))(*args)
    assert np.all(np.isneginf(np.asarray(tau)[1])) and np.all(np.asarray(total)[1] == 0)
    np.testing.assert_array_equal(np.isneginf(np.asarray(tau)), np.isneginf(np.asarray(tau2)))
    finite = np.isfinite(np.asarray(tau2))
    np.testing.assert_allclose(np.asarray(tau)[finite], np.asarray(tau2)[finite], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(total), np.asarray(total2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(tau, np.float64)[0], want["tau"][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(total, np.float64)[0], want["t"][0], rtol=1e-5, atol=1e-5)
