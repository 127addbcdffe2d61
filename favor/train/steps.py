"""The step functions of training and evaluation: functions of (state, batch) whose static parts are
keyword arguments, bound with functools.partial before jit (as the Flax examples do), so a test can call
any of them alone; the training loop (favor.train.loop) builds on them, and `stage_step` runs any stage
(favor.train.stage) with the same guard as the training step.

The train state is a pytree {step, params, rest, opt_state, bad_step}: `params` the model's nnx.Param
state, `rest` everything else the model holds (random-feature draws, dropout rng counters, batch stats).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from favor import models
from favor.attention import schedule


def init_state(model, tx, stages=()) -> dict:
    """The train state of a fresh `model`, with each stage's entries and optimizer state (the entries are
    made again from the run's starting parameters when it starts from another model's)."""
    _, params, rest = nnx.split(model, nnx.Param, ...)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "rest": rest,
             "opt_state": tx.init(params), "bad_step": jnp.full((), -1, jnp.int32)}
    for stage in stages:
        state.update(stage.entries(params))
        state[stage.opt_key] = stage.tx.init(params)
    return state


def freeze(params, trainable):
    """`params` with every leaf the bool tree `trainable` does not train under stop_gradient (None: all
    train): their gradients are symbolic zeros, so a step computes no weight gradient for a frozen
    projection (a LoRA run's base weights)."""
    if trainable is None:
        return params
    return jax.tree.map(lambda p, t: p if t else jax.lax.stop_gradient(p), params, trainable)


def loss_fn(params, rest, batch, *, graphdef, task, trainable=None):
    """(loss, (metrics, rest after the call)) of the task on one batch, in training mode."""
    # copy=True: fresh Variables in this (grad) trace, so dropout may advance its rng counter
    model = nnx.merge(graphdef, freeze(params, trainable), rest, copy=True)
    loss, metrics = task.loss(model, batch, deterministic=False)
    _, _, new_rest = nnx.split(model, nnx.Param, ...)
    return loss, (metrics, new_rest)


def gradients(loss, params, rest, batch, accumulate: int = 1):
    """(loss, metrics, rest, grads) of `loss(params, rest, batch) -> (loss, (metrics, rest))`. With
    accumulate > 1 the batch is split into that many microbatches, run in a scan (the memory of one,
    the update of all) and the losses, metrics and gradients averaged: equal to one big batch for a loss
    that is a mean over equal microbatches."""
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    if accumulate == 1:
        (value, (metrics, rest)), grads = grad_fn(params, rest, batch)
        return value, metrics, rest, grads
    micro = jax.tree.map(lambda x: x.reshape(accumulate, x.shape[0] // accumulate, *x.shape[1:]), batch)

    def body(carry, mb):
        g_sum, l_sum, m_sum, r = carry
        (value, (m, r)), g = grad_fn(params, r, mb)
        return (jax.tree.map(jnp.add, g_sum, g), l_sum + value, jax.tree.map(jnp.add, m_sum, m), r), None

    shapes = jax.eval_shape(grad_fn, params, rest, jax.tree.map(lambda x: x[0], micro))
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
    carry = (zeros(shapes[1]), zeros(shapes[0][0]), zeros(shapes[0][1][0]), rest)
    (grads, value, metrics, rest), _ = jax.lax.scan(body, carry, micro)
    mean = lambda tree: jax.tree.map(lambda x: x / accumulate, tree)
    return value / accumulate, mean(metrics), rest, mean(grads)


def with_features(params, rest, *, graphdef, key):
    """`rest` with every attention layer's ω drawn afresh from `key`."""
    model = nnx.merge(graphdef, params, rest, copy=True)
    models.redraw_features(model, key)
    return nnx.split(model, nnx.Param, ...)[2]


def _all_finite(tree):
    return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def apply_if_finite(state, loss, grads, **updated):
    """`state` with the entries of `updated` and the step advanced, when the loss, the gradients and the
    new parameters are finite; otherwise `state` as it was (step advanced) and `bad_step` set to the
    first such step."""
    step = state["step"]
    finite = jnp.isfinite(loss) & _all_finite(grads) & _all_finite(updated["params"])   # params: a bad lr
    new_state = dict(state, step=step + 1, bad_step=jnp.where(~finite & (state["bad_step"] < 0), step,
                                                               state["bad_step"]))
    # one conditional picks the whole update: with a jnp.where per leaf, XLA fuses the chain of per-leaf
    # finiteness tests into every leaf's select, a program quadratic in the number of arrays (most of a
    # small model's train-step compile)
    new_state.update(jax.lax.cond(finite, lambda: updated, lambda: {k: state[k] for k in updated}))
    return new_state


def train_step(state, batch, *, graphdef, task, tx, lr_schedule, redraw: schedule.Redraw | None = None,
               features_base=None, accumulate: int = 1, trainable=None):
    """One optimizer step: (new state, metrics). `redraw` (with `features_base`, the ω stream's key):
    the ω schedule, None to keep the stored ω. `trainable`: a bool per parameter (None: all), the others
    frozen (`tx` must leave them alone too). A non-finite loss, gradient or update is not applied: the
    state stays and `bad_step` records the first such step (the loop stops on it)."""
    step, rest = state["step"], state["rest"]
    if redraw is not None and redraw.redraws:
        rest = with_features(state["params"], rest, graphdef=graphdef, key=redraw.key(features_base, step))
    loss, metrics, rest, grads = gradients(partial(loss_fn, graphdef=graphdef, task=task, trainable=trainable),
                                           state["params"], rest, batch, accumulate)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = apply_if_finite(state, loss, grads, params=params, rest=rest, opt_state=opt_state)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), learning_rate=lr_schedule(step))
    return new_state, metrics


def stage_step(state, batch, *, stage, graphdef, task, redraw: schedule.Redraw | None = None, features_base=None):
    """One step of `stage` (favor.train.stage.Stage): its loss differentiated in the parameters, its
    optimizer, the same guard and ω schedule as `train_step`. Metrics: loss, grad_norm, and the stage's
    own under "<name>/"."""
    step, rest = state["step"], state["rest"]
    if redraw is not None and redraw.redraws:
        rest = with_features(state["params"], rest, graphdef=graphdef, key=redraw.key(features_base, step))
    entries = {k: state[k] for k in stage.entry_keys}
    objective = lambda params, *a: stage.loss(freeze(params, stage.trainable), *a, graphdef=graphdef, task=task)
    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state["params"], rest, entries, batch)
    updates, opt_state = stage.tx.update(grads, state[stage.opt_key], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = apply_if_finite(state, loss, grads, params=params, rest=rest, **{stage.opt_key: opt_state})
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), f"{stage.name}/loss": loss,
                       **{f"{stage.name}/{k}": v for k, v in metrics.items()}}


def evaluate_stage(state, batches, *, stage, step_fn, features_fn=None) -> list[float]:
    """A stage's evaluation over `batches`: `step_fn(params, rest, entries, batch) -> (values, weight)`,
    the values averaged with those weights, with the evaluation ω."""
    rest = state["rest"] if features_fn is None else features_fn(state["params"], state["rest"])
    entries = {k: state[k] for k in stage.entry_keys}
    total, n = 0.0, 0.0
    for batch in batches:
        values, weight = jax.device_get(step_fn(state["params"], rest, entries, batch))
        total, n = total + values * weight, n + weight
    return [float(x) / max(float(n), 1.0) for x in total]


def eval_step(params, rest, batch, *, graphdef, task):
    return task.eval_outputs(nnx.merge(graphdef, params, rest, copy=True), batch)


def evaluate(state, batches, *, step_fn, finalize, features_fn=None) -> dict:
    """The task's metrics over `batches` (global arrays): `step_fn(params, rest, batch)` per batch, the
    outputs brought to the host, then `finalize`. `features_fn(params, rest)`: the ω evaluation uses
    (None: the stored one)."""
    rest = state["rest"] if features_fn is None else features_fn(state["params"], state["rest"])
    return finalize([jax.device_get(step_fn(state["params"], rest, batch)) for batch in batches])
