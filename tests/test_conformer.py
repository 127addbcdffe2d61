"""The Conformer encoder: subsampled shapes and lengths, padding invariance (every attention kind and
conv norm), jit and CTC gradients, input errors, the published size."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from favor import models

B, T, F = 2, 40, 16
LENGTHS = np.array([40, 25])


def ref_length(n):
    """The VALID stride-2 3-wide conv length formula, twice, in plain Python."""
    for _ in range(2):
        n = max((n - 3) // 2 + 1, 0)
    return n


def feats(t=T, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, t, F)), jnp.float32)


@nnx.jit(static_argnames="deterministic")
def forward(model, features, lengths=None, deterministic=True):
    """The model under nnx.jit: one compile per shape beats eager op-by-op dispatch."""
    return model(features, lengths, deterministic=deterministic)


def build(rngs=None, **overrides):
    return models.get("conformer", "tiny", rngs=rngs or nnx.Rngs(0), **overrides)


@pytest.fixture(scope="module")
def tiny():
    return build()


def test_shapes_lengths_and_mask(tiny):
    c = tiny.config
    for t, lengths in [(7, [7, 6]), (48, [0, 48]), (48, [47, 23])]:   # few shapes: each one compiles
        out = forward(tiny, feats(t), jnp.asarray(lengths))
        t_out = ref_length(t)
        assert out["hidden_states"].shape == (B, t_out, c["hidden"])
        assert out["logits"].shape == (B, t_out, c["vocab_size"] + 1)
        assert out["logits"].dtype == jnp.float32
        assert out["mask"].shape == (B, t_out) and out["mask"].dtype == jnp.bool_
        want = [ref_length(n) for n in lengths]
        np.testing.assert_array_equal(np.asarray(out["lengths"]), want)
        np.testing.assert_array_equal(np.asarray(out["mask"]), np.arange(t_out)[None] < np.array(want)[:, None])
        h = np.asarray(out["hidden_states"])
        assert np.all(np.isfinite(h)) and np.all(np.isfinite(np.asarray(out["logits"])))
        assert np.all(h[~np.asarray(out["mask"])] == 0)
    assert [ref_length(n) for n in (0, 2, 6, 7, 10, 11, 23, 40, 41)] == [0, 0, 0, 1, 1, 2, 5, 9, 9]
    out = forward(tiny, feats(48))                                                # lengths=None: all valid
    np.testing.assert_array_equal(np.asarray(out["lengths"]), [ref_length(48)] * B)
    assert bool(jnp.all(out["mask"]))


def padded_variant(x, extra=8, seed=1):
    """x with example 1's padded frames replaced by large noise and `extra` noise frames appended to
    both examples: the same valid frames, more and different padding. Any leak shows: padded frames
    that reached the depthwise conv or the BatchNorm statistics would differ between the two."""
    rng = np.random.default_rng(seed)
    x = x.at[1, LENGTHS[1]:].set(jnp.asarray(5.0 * rng.standard_normal((T - LENGTHS[1], F)), jnp.float32))
    return jnp.concatenate([x, jnp.asarray(5.0 * rng.standard_normal((B, extra, F)), jnp.float32)], 1)


def _invariance(model, deterministic):
    """Max change of the valid outputs of both examples when the padding changes (must be ~0), and of
    example 1's when one of its valid frames changes (the control, must be large)."""
    x = feats()
    lengths = jnp.asarray(LENGTHS)
    x_pad = padded_variant(x)
    x_valid = x.at[1, 10].add(3.0)
    base, pad, valid = (forward(model, u, lengths, deterministic=deterministic) for u in (x, x_pad, x_valid))
    n = [ref_length(int(n)) for n in LENGTHS]
    assert n == list(np.asarray(base["lengths"])) == list(np.asarray(pad["lengths"])) == [9, 5]
    assert pad["hidden_states"].shape[1] == ref_length(T + 8) == 11
    diff = lambda a, key, ex: float(jnp.max(jnp.abs(a[key][ex, :n[ex]] - base[key][ex, :n[ex]])))
    return (max(diff(pad, "hidden_states", 0), diff(pad, "hidden_states", 1)),
            max(diff(pad, "logits", 0), diff(pad, "logits", 1)), diff(valid, "hidden_states", 1))


@pytest.mark.parametrize("conv_norm", ["layer", "batch"])
@pytest.mark.parametrize("attention", [{"kind": "softmax"}, {"kind": "favor+", "num_features": 32}],
                         ids=["softmax", "favor+"])
def test_padding_invariance(conv_norm, attention):
    model = build(conv_norm=conv_norm, attention=attention)
    hidden, logits, control = _invariance(model, deterministic=True)
    assert hidden < 1e-5 and logits < 1e-4, (hidden, logits)
    assert control > 1e-3, control


def test_batchnorm_training_statistics_ignore_padding():
    """deterministic=False, dropout 0: BatchNorm normalises with batch statistics over valid frames only,
    so outputs and the updated running averages do not see padded frames."""
    model = build(rngs=nnx.Rngs(params=0, dropout=1, features=2), conv_norm="batch", dropout=0.0)
    hidden, logits, control = _invariance(model, deterministic=False)
    assert hidden < 1e-5 and logits < 1e-4, (hidden, logits)
    assert control > 1e-3, control

    x, lengths = feats(), jnp.asarray(LENGTHS)
    def stats_after(u):
        m = nnx.clone(model)
        forward(m, u, lengths, deterministic=False)
        return jax.tree.leaves(nnx.state(m, nnx.BatchStat))
    before = jax.tree.leaves(nnx.state(model, nnx.BatchStat))
    base = stats_after(x)
    padded = stats_after(padded_variant(x))
    changed = stats_after(x.at[1, 3].add(3.0))
    assert len(base) == 2 * model.config["num_layers"]                     # mean and var per block
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(base, before)) > 1e-4    # stats did update
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(base, padded)) < 1e-6
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(base, changed)) > 1e-6


def test_jit_ctc_gradient_and_dropout():
    model = build(rngs=nnx.Rngs(params=0, dropout=1, features=2))
    x, lengths = feats(), jnp.asarray(LENGTHS)
    labels = jnp.asarray([[3, 5, 7], [2, 9, 0]], jnp.int32)
    label_paddings = jnp.asarray([[0, 0, 0], [0, 0, 1]], jnp.float32)

    def ctc(m, deterministic):
        out = m(x, lengths, deterministic=deterministic)
        paddings = 1.0 - out["mask"].astype(jnp.float32)
        loss = jnp.mean(optax.ctc_loss(out["logits"], paddings, labels, label_paddings, blank_id=0))
        return loss, out

    @nnx.jit
    def train_step(m):   # dropout on; nnx.jit carries the advanced dropout stream back into the model
        return nnx.value_and_grad(lambda mm: ctc(mm, False), has_aux=True)(m)

    (loss, out), grads = train_step(model)
    assert np.isfinite(float(loss)) and float(loss) > 0
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert sum(float(jnp.sum(g ** 2)) for g in leaves) > 0
    assert bool(jnp.all(jnp.isfinite(out["hidden_states"])))

    (loss2, out2), _ = train_step(model)                        # same compile, fresh dropout masks
    assert float(jnp.max(jnp.abs(out2["hidden_states"] - out["hidden_states"]))) > 1e-3
    assert float(loss2) != float(loss)


def test_bad_inputs_name_the_value(tiny):
    with pytest.raises(ValueError, match=r"\[batch, frames, 16\].*\(2, 40, 17\)"):
        tiny(jnp.ones((2, 40, 17)), jnp.asarray(LENGTHS))
    with pytest.raises(ValueError, match="6 frames are too few"):
        tiny(jnp.ones((2, 6, 16)), jnp.asarray([6, 6]))
    with pytest.raises(ValueError, match=r"unknown conv_norm 'group'; valid: batch, layer"):
        build(conv_norm="group")


def test_every_param_has_logical_axes(tiny):
    params = jax.tree.leaves(nnx.state(tiny, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert len(params) > 20
    for v in params:
        axes = v.get_metadata().get("logical_axes")
        assert axes is not None and len(axes) == v[...].ndim, (v, axes)


def test_small_preset_size():
    model = nnx.eval_shape(lambda: models.get("conformer", "small", rngs=nnx.Rngs(0)))
    c = model.config
    assert (c["num_layers"], c["heads"], c["hidden"]) == (17, 4, 256)   # CRT Table 6
    n = models.param_count(model)
    assert 15e6 < n < 40e6, n   # 27,794,689 at the time of writing


def test_without_self_attention_the_blocks_hold_no_attention_and_mix_only_through_the_convolution():
    """self_attention=False (the floor of the speech ablation): no attention parameters, the same output
    shapes, padding still invisible; and with a 1-frame convolution an output frame reads only its own
    7 input frames, so changing input frames 20+ (T = 40) leaves output frame 0 unchanged, while the
    same change moves frame 0 once attention is back."""
    floor = build(self_attention=False, conv_kernel=1)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(floor, nnx.Param))}
    assert not any("attention" in n for n in names) and any("conv" in n for n in names), sorted(names)[:5]
    hidden, logits, control = _invariance(floor, deterministic=True)
    assert hidden < 1e-5 and logits < 1e-4 and control > 1e-3, (hidden, logits, control)
    x = feats()
    far = x.at[:, 20:].add(5.0)
    for model, moves in ((floor, False), (build(conv_kernel=1), True)):
        a, b = forward(model, x)["hidden_states"], forward(model, far)["hidden_states"]
        assert bool(jnp.max(jnp.abs(a[:, 0] - b[:, 0])) > 1e-4) == moves, moves
