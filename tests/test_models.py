"""The model zoo: every family × every attention kind under jit and grad, masks, parameter trees,
logical axes, presets and the published parameter counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor import attention, models
from favor.models.layers import AXES, FeatureDraw

FAMILIES = ("bert", "vit", "conformer")


def attn_cfg(kind):
    # small feature widths keep every kind fast (hrf: 16 = m 2 × 4·(n 1 + 1))
    return {"kind": kind} if kind in ("softmax", "relu", "elu") else {"kind": kind, "num_features": 16}


def build(family, kind="softmax", seed=0, **overrides):
    overrides.setdefault("num_layers", 1)
    return models.get(family, "tiny", rngs=nnx.Rngs(params=seed, dropout=seed + 1, features=seed + 2),
                      attention=attn_cfg(kind), **overrides)


def inputs(family, b=2):
    rng = np.random.RandomState(0)
    if family == "bert":
        ids = rng.randint(0, 1024, (b, 12))
        mask = np.ones((b, 12), bool)
        mask[1, 8:] = False
        return (jnp.asarray(ids),), {"attention_mask": jnp.asarray(mask)}
    if family == "vit":
        return (jnp.asarray(rng.normal(size=(b, 32, 32, 3)), jnp.float32),), {}
    feats = jnp.asarray(rng.normal(size=(b, 40, 16)), jnp.float32)
    return (feats, jnp.array([40, 27])), {}


@nnx.jit
def call(model, *args, **kwargs):
    """model(*args, **kwargs) as one compiled program (eager, each operation compiles on its own)."""
    return model(*args, **kwargs)


def loss_and_grads(model, family):
    """A loss of the model's outputs and its gradients to the parameters, as one jitted program (as a
    training step compiles them; the gradient of a jitted loss taken eagerly compiles two)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    args, kwargs = inputs(family)

    def loss(params, rest, args, kwargs):
        out = nnx.merge(graphdef, params, rest)(*args, **kwargs)
        return jnp.mean(out["logits"].astype(jnp.float32) ** 2) + jnp.mean(out["hidden_states"].astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss))(params, rest, args, kwargs)


@pytest.mark.parametrize("kind", attention.names())
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_grad_every_model_every_kind(family, kind):
    value, grads = loss_and_grads(build(family, kind), family)
    assert np.isfinite(float(value))
    flat = jax.tree.leaves(grads)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in flat)
    # the attention projections receive gradient (the kind is really in the path)
    q_grad = [g for p, g in jax.tree_util.tree_leaves_with_path(grads)
              if "query" in jax.tree_util.keystr(p) and "kernel" in jax.tree_util.keystr(p)]
    assert q_grad and float(jnp.max(jnp.abs(q_grad[0]))) > 0


@pytest.mark.parametrize("kind", ["softmax", "favor+", "favor#", "hrf"])
def test_bert_padding_has_no_influence(kind):
    model = build("bert", kind)
    (ids,), kw = inputs("bert")
    out = call(model, ids, **kw)["hidden_states"]
    ids2 = ids.at[1, 8:].set(7)                 # change only the padded tokens of example 1
    out2 = call(model, ids2, **kw)["hidden_states"]
    np.testing.assert_allclose(np.asarray(out2[1, :8]), np.asarray(out[1, :8]), atol=1e-5)
    ids3 = ids.at[1, 3].set(11)                 # control: a valid token does change them
    assert float(jnp.max(jnp.abs(call(model, ids3, **kw)["hidden_states"][1, :8] - out[1, :8]))) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_tree_is_the_same_for_every_kind(family):
    def tree(kind):
        m = nnx.eval_shape(lambda: build(family, kind, num_layers=2))
        return jax.tree.map(lambda a: (a.shape, a.dtype), nnx.to_pure_dict(nnx.state(m, nnx.Param)))

    reference = tree("softmax")
    for kind in attention.names():
        got = tree(kind)
        if getattr(attention.get(kind), "learned", False):
            # a learned map's weights are parameters of each attention layer beside the softmax model's
            # (init_from starts them fresh from a checkpoint of another kind)
            for layer in got["layers"].values():
                assert layer["attention"].pop("feature_map")[1] == np.float32
        assert got == reference, kind


@pytest.mark.parametrize("family", FAMILIES)
def test_random_features_are_state_not_parameters(family):
    model = build(family, "favor++")
    draws = nnx.state(model, FeatureDraw)
    assert len(jax.tree.leaves(draws)) > 0
    assert not jax.tree.leaves(nnx.state(build(family, "softmax"), FeatureDraw))
    args, kw = inputs(family)
    a, b = model(*args, **kw)["hidden_states"], model(*args, **kw)["hidden_states"]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))     # evaluation is deterministic
    models.redraw_features(model, jax.random.PRNGKey(5))
    c = model(*args, **kw)["hidden_states"]
    assert float(jnp.max(jnp.abs(c - a))) > 1e-6                      # a redraw changes ω and output
    layers = [np.asarray(jax.tree.leaves(v)[0]) for v in jax.tree.leaves(
        nnx.state(build(family, "favor++", num_layers=2), FeatureDraw), is_leaf=lambda x: isinstance(x, nnx.Variable))]
    assert not np.allclose(layers[0], layers[-1])                     # each layer draws its own ω


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_has_logical_axes(family):
    model = nnx.eval_shape(lambda: build(family, "favor+", num_layers=2))
    axes = models.logical_axes(model)
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(params)
    names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    assert len(names) == len(leaves)
    for n, p in zip(names, leaves):
        assert len(n) == p.ndim and all(a is None or a in AXES for a in n), (n, p.shape)
    assert any("vocab" in n or "heads" in n for n in names) and any("mlp" in n for n in names)


def test_published_parameter_counts():
    count = lambda *a, **k: models.param_count(nnx.eval_shape(lambda: models.get(*a, **k)))
    assert count("bert", "base", head="none") == 109_482_240        # bert-base-uncased BertModel
    assert count("vit", "base") == 86_567_656                        # ViT-B/16, 1000 classes
    assert 330e6 < count("bert", "large", head="none") < 340e6       # BERT-large: 335M


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_compute_float32_params(family):
    model = build(family, "favor#", dtype="bfloat16")
    args, kw = inputs(family)
    out = model(*args, **kw)
    assert out["hidden_states"].dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(out["logits"], np.float32)))
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("float32")}


@pytest.mark.parametrize("family", FAMILIES)
def test_dropout_changes_training_output_only(family):
    model = build(family, "favor+", dropout=0.3, attention_dropout=0.3)
    args, kw = inputs(family)
    e1, e2 = model(*args, **kw)["hidden_states"], model(*args, **kw)["hidden_states"]
    t1 = model(*args, deterministic=False, **kw)["hidden_states"]
    t2 = model(*args, deterministic=False, **kw)["hidden_states"]
    np.testing.assert_array_equal(np.asarray(e1), np.asarray(e2))
    assert float(jnp.max(jnp.abs(t1 - e1))) > 1e-4 and float(jnp.max(jnp.abs(t1 - t2))) > 1e-4


def test_heads():
    (ids,), kw = inputs("bert")
    for head, shape in (("mlm", (2, 12, 1024)), ("classification", (2, 3)), ("regression", (2,))):
        out = call(build("bert", head=head, num_labels=3), ids, **kw)
        assert out["logits"].shape == shape, head
    assert "logits" not in call(build("bert", head="none"), ids, **kw)
    vit = build("vit", pool="mean", num_classes=5)
    out = call(vit, *inputs("vit")[0])
    assert out["hidden_states"].shape == (2, 64, 64) and out["logits"].shape == (2, 5)
    # sequence length is a config change: 32/8 -> 16 patches + class token
    assert call(build("vit", patch_size=8), *inputs("vit")[0])["hidden_states"].shape == (2, 17, 64)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model 'gpt'.*bert"):
        models.get("gpt")
    with pytest.raises(ValueError, match="unknown bert preset 'huge'.*tiny"):
        models.get("bert", "huge")
    with pytest.raises(ValueError, match="unknown bert option.*'hiden'.*hidden"):
        models.get("bert", hiden=3)
    with pytest.raises(ValueError, match="bert: attention: unknown attention kind .favour.; valid: .*favor\\+\\+"):
        models.get("bert", attention={"kind": "favour"})
    with pytest.raises(ValueError, match="num_featurez"):
        models.get("bert", attention={"kind": "favor+", "num_featurez": 3})
    with pytest.raises(ValueError, match="dtype must be one of.*'int8'"):
        models.get("vit", dtype="int8")
    with pytest.raises(ValueError, match="not a multiple of the number of heads"):
        models.get("bert", hidden=65)
    vit = build("vit")
    with pytest.raises(ValueError, match=r"images must be \[batch, 32, 32, 3\].*\(2, 28, 28, 3\)"):
        vit(jnp.zeros((2, 28, 28, 3)))
    with pytest.raises(ValueError, match="input_ids must be"):
        build("bert")(jnp.zeros((12,), jnp.int32))


def test_vit_sincos2d_positions_are_fixed_and_two_dimensional():
    from favor.models.vit import sincos2d
    table = np.asarray(sincos2d(4, 4, 8))                            # [16, 8]: sin x, cos x, sin y, cos y
    np.testing.assert_allclose(table[0], [0, 0, 1, 1, 0, 0, 1, 1], atol=1e-7)     # (row 0, col 0)
    np.testing.assert_allclose(table[1, :2], np.sin([1.0, 0.01]), rtol=1e-6)      # col 1, freqs 1 and 1/100
    np.testing.assert_allclose(table[4, 4:6], np.sin([1.0, 0.01]), rtol=1e-6)     # row 1
    learned = build("vit", posemb="learn")
    fixed = build("vit", posemb="sincos2d", pool="mean")
    n_params = lambda m: models.param_count(m)
    assert n_params(learned) - n_params(fixed) == 65 * 64 + 64     # no position table, no class token
    out = fixed(*inputs("vit")[0])
    assert out["hidden_states"].shape == (2, 64, 64)
    with pytest.raises(ValueError, match="unknown posemb 'rope'"):
        build("vit", posemb="rope")


def test_bert_mean_pool_reads_only_valid_tokens():
    """pool="mean": the pooler reads the mean over valid tokens, so what padding holds changes nothing,
    and with no layers it is the bag of token embeddings (configs/listops.py:bag)."""
    model = models.get("bert", "tiny", head="classification", num_labels=3, pool="mean", num_layers=0,
                       rngs=nnx.Rngs(0))
    ids = jnp.asarray([[5, 6, 7, 0, 0], [5, 6, 7, 9, 9]])
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    out = model(ids, None, mask)
    np.testing.assert_allclose(out["pooled"][0], out["pooled"][1], atol=1e-6)
    x = model.embedding_norm(model.word_embeddings(ids[:1, :3]) + model.position_embeddings(jnp.arange(3))[None]
                             + model.token_type_embeddings(jnp.zeros((1, 3), jnp.int32)))
    want = jnp.tanh(model.pooler(x.mean(1)))
    np.testing.assert_allclose(out["pooled"][:1], want, atol=1e-5)
    with pytest.raises(ValueError, match="unknown pool 'max'; valid: cls, mean"):
        models.get("bert", "tiny", pool="max", rngs=nnx.Rngs(0))
