"""Attention transfer: before fine-tuning, train the model around a random-feature attention to
reproduce the softmax attention it replaces, layer by layer (LoLCATs' attention transfer, adapted: favor's
kernels have no learned feature map, so what moves are the projections that feed them).

The teacher is the same model with exact softmax attention and the parameters the run started from,
frozen. One forward of the teacher records, for every attention layer, its input, its mask and its
output; each of the student's attention layers (the run's kind, the trained parameters) is then applied
to that same input, and the loss is the sum over layers of the mean squared difference of the outputs
(over valid tokens and hidden units). Layers are trained on the teacher's inputs, so one layer's error
does not feed the next during this stage.

`config.uptrain`: transfer_steps (0 = no transfer stage), trainable ("query_key": the attention layers'
query and key projections; "all"; or a regular expression searched in the dotted parameter paths), lr
(the stage's Adam learning rate, cosine-decayed over the stage).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from favor.models.layers import SelfAttention
from favor.train.steps import apply_if_finite, with_features


def teacher_of(build_softmax):
    """(graphdef, rest) of the softmax twin of a model, its attention layers set to record."""
    model = build_softmax()
    for _, m in nnx.iter_graph(model):
        if isinstance(m, SelfAttention):
            m.record = True
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, rest


def _attention_paths(model):
    return [tuple(path) for path, m in nnx.iter_graph(model) if isinstance(m, SelfAttention)]


def _get(model, path):
    for p in path:
        model = model[p] if isinstance(p, int) else getattr(model, p)
    return model


def layer_errors(params, rest, teacher_params, batch, *, graphdef, teacher, task):
    """([num attention layers] mean squared error between each student attention layer's output and the
    softmax teacher's, on the teacher's inputs to that layer; the number of tokens it averages over).
    Deterministic (no dropout); padding tokens and padding rows (batch["valid"]) do not count."""
    t_graphdef, t_rest = teacher
    t_model = nnx.merge(t_graphdef, jax.lax.stop_gradient(teacher_params), t_rest, copy=True)
    _, captured = nnx.capture(lambda m, b: task.loss(m, b, deterministic=True), nnx.Intermediate)(t_model, batch)
    student = nnx.merge(graphdef, params, rest, copy=True)
    errors, count = [], None
    for path in _attention_paths(student):
        node = captured
        for p in path:
            node = node[p]
        x, mask, positions, target = jax.lax.stop_gradient(node["transfer"].get_value()[0])
        out = _get(student, path)(x, mask, deterministic=True, positions=positions)
        sq = jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32)).mean(-1)     # [B, L]
        w = jnp.ones(sq.shape, jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
        if "valid" in batch:
            w = w * jnp.asarray(batch["valid"], jnp.float32)[:, None]
        count = w.sum()
        errors.append((sq * w).sum() / jnp.maximum(count, 1.0))
    return jnp.stack(errors), count


def loss_fn(params, rest, teacher_params, batch, **kw):
    errors, _ = layer_errors(params, rest, teacher_params, batch, **kw)
    return errors.sum(), errors


def optimizer(uptrain, trainable_mask) -> optax.GradientTransformation:
    """Adam at `uptrain.lr` (5 % warmup, cosine decay over the stage) on the chosen parameters. The
    others' gradients are zeroed first (so they count in no clipping norm) and Adam then gives them an
    exactly zero update (its moments stay 0; no weight decay)."""
    steps = max(int(uptrain.transfer_steps), 1)
    lr = optax.warmup_cosine_decay_schedule(0.0, float(uptrain.lr), max(steps // 20, 1), steps)
    frozen = jax.tree.map(lambda t: not t, trainable_mask)
    return optax.chain(optax.masked(optax.set_to_zero(), frozen), optax.clip_by_global_norm(1.0), optax.adam(lr))


def transfer_step(state, batch, *, graphdef, teacher, task, tx, redraw=None, features_base=None):
    """One transfer-stage step: (new state, metrics). The same guard as train_step: a non-finite loss or
    gradient is not applied and `bad_step` records it."""
    step, rest = state["step"], state["rest"]
    if redraw is not None and redraw.redraws:
        rest = with_features(state["params"], rest, graphdef=graphdef, key=redraw.key(features_base, step))
    grad_fn = jax.value_and_grad(partial(loss_fn, graphdef=graphdef, teacher=teacher, task=task), has_aux=True)
    (loss, errors), grads = grad_fn(state["params"], rest, state["teacher"], batch)
    updates, opt_state = tx.update(grads, state["transfer_opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = apply_if_finite(state, loss, grads, params=params, rest=rest, transfer_opt_state=opt_state)
    metrics = {"transfer/loss": loss, "grad_norm": optax.tree.norm(grads), "loss": loss,
               **{f"transfer/mse_layer_{i}": e for i, e in enumerate(errors)}}
    return new_state, metrics


def eval_errors(state, batches, *, step_fn, features_fn=None) -> list[float]:
    """Per-layer attention MSE over all valid tokens of `batches` (held-out data), with the evaluation ω."""
    rest = state["rest"] if features_fn is None else features_fn(state["params"], state["rest"])
    total, n = 0.0, 0.0
    for batch in batches:
        errors, count = jax.device_get(step_fn(state["params"], rest, state["teacher"], batch))
        total, n = total + errors * count, n + count
    return [float(x) / max(float(n), 1.0) for x in total]
