"""The optimizer pieces: schedules, the weight-decay mask, layer-wise LR decay; and the sweep launcher."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor import models
from favor.config import loading
from favor.train import optim

ROOT = Path(__file__).resolve().parents[1]


def ocfg(**kw):
    return loading.optim(**{"lr": 1e-3, "warmup_steps": 10, "weight_decay": 0.1, "clip_norm": 0.0, **kw})


def test_schedules_warm_up_then_decay():
    for kind, end in (("cosine", 0.0), ("linear", 0.0), ("constant", 1e-3)):
        lr = optim.schedule(ocfg(schedule=kind), 110)
        assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(5e-4)
        assert float(lr(10)) == pytest.approx(1e-3)
        assert float(lr(110)) == pytest.approx(end, abs=1e-9)
    assert float(optim.schedule(ocfg(schedule="cosine"), 110)(60)) == pytest.approx(5e-4, rel=1e-3)
    with pytest.raises(ValueError, match="unknown optim.schedule 'step'.*cosine"):
        optim.schedule(ocfg(schedule="step"), 10)
    with pytest.raises(ValueError, match="unknown optim.name 'lamb'.*adamw"):
        optim.make(ocfg(name="lamb"), 10)


def test_weight_decay_touches_matrices_only():
    params = {"kernel": jnp.ones((3, 3)), "bias": jnp.ones((3,)), "scale": jnp.ones((3,))}
    tx, _ = optim.make(ocfg(lr=0.0, warmup_steps=0, schedule="constant", weight_decay=0.5), 10)
    zero = jax.tree.map(jnp.zeros_like, params)
    upd, _ = tx.update(zero, tx.init(params), params)
    # with lr 0 nothing moves; at lr 1 the decoupled decay is −lr·wd·p on the kernel only
    tx1, _ = optim.make(ocfg(lr=1.0, warmup_steps=0, schedule="constant", weight_decay=0.5), 10)
    upd1, _ = tx1.update(zero, tx1.init(params), params)
    np.testing.assert_allclose(upd1["kernel"], -0.5 * np.ones((3, 3)), atol=1e-6)
    np.testing.assert_allclose(upd1["bias"], 0.0, atol=1e-6)
    np.testing.assert_allclose(upd1["scale"], 0.0, atol=1e-6)
    assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(upd))


def test_layer_decay_scales_by_depth():
    model = nnx.eval_shape(lambda: models.get("vit", "tiny", num_layers=3))
    params = nnx.state(model, nnx.Param)
    ids = optim.layer_ids(params, 3)
    flat = {jax.tree_util.keystr(p): i for p, i in jax.tree_util.tree_leaves_with_path(ids)}
    depth = lambda part: {i for k, i in flat.items() if part in k}
    assert depth("patch_embedding") == {0} and depth("position_embeddings") == {0}
    assert depth("['layers'][0]") == {1} and depth("['layers'][2]") == {3}
    assert depth("['head']") == {4} and depth("['norm']") == {4}
    concrete = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), params)
    tx, _ = optim.make(ocfg(name="sgd", lr=1.0, warmup_steps=0, schedule="constant", layer_decay=0.5,
                            momentum=0.0), 10, params=concrete, num_layers=3)
    grads = jax.tree.map(jnp.ones_like, concrete)
    upd, _ = tx.update(grads, tx.init(concrete), concrete)
    scale = {jax.tree_util.keystr(p): float(jnp.abs(u).max()) for p, u in jax.tree_util.tree_leaves_with_path(upd)}
    for key, value in scale.items():
        assert value == pytest.approx(0.5 ** (4 - flat[key])), key


def test_sweep_launcher_runs_each_override():
    out = subprocess.run([sys.executable, str(ROOT / "launch/sweep_local.py"), "--config", "configs/default.py",
                          "--workdir", "/tmp/sweep", "--dry-run", "--", "--config.total_steps=5"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    kinds = [line.split("--config.model.attention.kind=")[1].split()[0] for line in out]
    seeds = [line.split("--config.seed=")[1].split()[0] for line in out]
    every = ["softmax", "relu", "elu", "favor", "favor+", "favor++", "favor#", "hrf", "simrf", "hedgehog", "t2r"]
    assert kinds == [k for k in every for _ in range(2)] and seeds == ["0", "1"] * len(every)   # kinds × 2 seeds
    assert all("--config.total_steps=5" in line and "/tmp/sweep/kind=" in line for line in out)


def test_layer_decay_under_a_frozen_mask():
    """Layer-wise decay inside favor.uptrain.transfer.masked (a LoRA run's optimizer): frozen leaves get a
    zero update and no state; trained ones the plain SGD step scaled by layer_decay^(n + 1 − depth)."""
    from favor.uptrain import transfer
    params = {"embed": jnp.ones((2, 2)), "layers": {"0": {"w": jnp.ones((2,))}, "1": {"w": jnp.ones((2,))}},
              "head": jnp.ones((3,))}
    mask = {"embed": False, "layers": {"0": {"w": True}, "1": {"w": False}}, "head": True}
    tx, _ = optim.make(ocfg(name="sgd", lr=1.0, warmup_steps=0, schedule="constant", layer_decay=0.5,
                            momentum=0.0), 10, params=params, num_layers=2)
    tx = transfer.masked(tx, mask)
    state = tx.init(params)
    upd, _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    assert float(jnp.max(jnp.abs(upd["embed"]))) == 0.0 and float(jnp.max(jnp.abs(upd["layers"]["1"]["w"]))) == 0.0
    assert float(jnp.max(jnp.abs(upd["layers"]["0"]["w"]))) == pytest.approx(0.5 ** 2)    # depth 1 of n = 2
    assert float(jnp.max(jnp.abs(upd["head"]))) == pytest.approx(1.0)                    # depth n + 1


def test_optimizer_state_shardings_follow_the_parameters_by_path():
    """sharding.like_params: AdamW's moments of a masked optimizer (frozen leaves MaskedNode, no state)
    take their parameter's sharding wherever optax nests them; counts and other leaves the default."""
    import optax
    from favor import sharding
    from favor.uptrain import transfer
    params = {"a": jnp.ones((4, 2)), "b": {"c": jnp.ones((4, 2)), "d": jnp.ones((3,))}}
    shard = {"a": "A", "b": {"c": "C", "d": "D"}}                # stand-ins: any leaf object passes through
    tx = transfer.masked(optax.adamw(1e-3), {"a": True, "b": {"c": False, "d": True}})
    state = jax.eval_shape(tx.init, params)
    got = sharding.like_params(state, params, shard, "rep")
    flat = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(got)[0]}
    moments = {k: s for k, s in flat.items() if "mu" in k or "nu" in k}
    assert sorted(moments.values()) == ["A", "A", "D", "D"]                # no state for the frozen 'c'
    assert all(s == "rep" for k, s in flat.items() if k not in moments)
