"""Attention transfer: before fine-tuning, train the model around a linear attention to reproduce the
softmax attention it replaces, layer by layer (LoLCATs' attention transfer). A learned kind (hedgehog,
t2r) trains its feature maps (trainable="feature_maps", LoLCATs' first stage, with the window's learned
mix where the kind has one); the random-feature kinds have no learned map, so what moves there are the
projections that feed them (and the learned mix).

The teacher is the same model with exact softmax attention and the parameters the run started from,
frozen. One forward of the teacher records, for every attention layer, its input, its mask and its
output; each of the student's attention layers (the run's kind, the trained parameters) is then applied
to that same input, and the loss is the sum over layers of the mean squared difference of the outputs
(over valid tokens and hidden units). Layers are trained on the teacher's inputs, so one layer's error
does not feed the next during this stage.

`config.uptrain`: transfer_steps (0 = no transfer stage), trainable ("query_key": the attention layers'
query and key projections; "all"; "feature_maps": a learned kind's maps (hedgehog, t2r) and a window's
learned mix (window_mix="learned"); "lora": LoRA
adapters (favor.models.lora) and what `lora_also` selects, in this stage and in the training after it,
every other parameter frozen; or a regular expression searched in the dotted parameter paths), lr (the
stage's Adam learning rate, cosine-decayed over the stage). `stage` gives the run its stage
(favor.train.stage): the teacher's parameters are its train-state entry "teacher".
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from favor.config.checks import ConfigError
from favor.models import lora
from favor.models.layers import SelfAttention
from favor.train.stage import Stage
from favor.uptrain.init_from import dotted


def teacher_of(build_softmax):
    """(graphdef, rest, its parameters' paths) of the softmax twin of a model, its attention layers set to
    record. The twin has every parameter of the student but a learned kind's feature maps."""
    model = build_softmax()
    for _, m in nnx.iter_graph(model):
        if isinstance(m, SelfAttention):
            m.record = True
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, rest, frozenset(tuple(p) for p, _ in nnx.to_flat_state(params))


def _attention_paths(model):
    return [tuple(path) for path, m in nnx.iter_graph(model) if isinstance(m, SelfAttention)]


def _get(model, path):
    for p in path:
        model = model[p] if isinstance(p, int) else getattr(model, p)
    return model


def layer_errors(params, rest, entries, batch, *, graphdef, teacher, task):
    """([num attention layers] mean squared error between each student attention layer's output and the
    softmax teacher's, on the teacher's inputs to that layer; the number of tokens it averages over).
    Deterministic (no dropout); padding tokens and padding rows (batch["valid"]) do not count."""
    t_graphdef, t_rest, t_paths = teacher
    t_params = nnx.filter_state(entries["teacher"], lambda path, _: tuple(path) in t_paths)
    t_model = nnx.merge(t_graphdef, jax.lax.stop_gradient(t_params), t_rest, copy=True)
    _, captured = nnx.capture(lambda m, b: task.loss(m, b, deterministic=True), nnx.Intermediate)(t_model, batch)
    student = nnx.merge(graphdef, params, rest, copy=True)
    errors, count = [], None
    for path in _attention_paths(student):
        node = captured
        for p in path:
            node = node[p]
        x, mask, positions, segment_ids, target = jax.lax.stop_gradient(node["transfer"].get_value()[0])
        out = _get(student, path)(x, mask, deterministic=True, positions=positions, segment_ids=segment_ids)
        sq = jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32)).mean(-1)     # [B, L]
        w = jnp.ones(sq.shape, jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
        if "valid" in batch:
            w = w * jnp.asarray(batch["valid"], jnp.float32)[:, None]
        count = w.sum()
        errors.append((sq * w).sum() / jnp.maximum(count, 1.0))
    return jnp.stack(errors), count


def loss_fn(params, rest, entries, batch, **kw):
    """(the sum of the layers' errors, {"mse_layer_<i>": each})."""
    errors, _ = layer_errors(params, rest, entries, batch, **kw)
    return errors.sum(), {f"mse_layer_{i}": e for i, e in enumerate(errors)}


# the `trainable` values that name a set: the query/key projections, everything, a learned kind's feature
# maps and the window's learned mix (LoLCATs' first stage trains these alone)
NAMED = {"query_key": r"attention\.(query|key)\.", "all": r"", "feature_maps": r"(^|\.)attention\.(feature_map|window_mix)$"}


def trainable_mask(params, pattern: str, also: str = ""):
    """A bool per parameter leaf: does `pattern` ("query_key", "all", "feature_maps", "lora": the
    adapters, or a regular expression searched in the dotted parameter path) select it; with "lora",
    `also` (a regular expression) adds parameters that train beside the adapters."""
    if pattern == "lora":
        extra = re.compile(also) if also else None
        pick = lambda path: lora.is_lora_param(path) or bool(extra and extra.search(path))
    else:
        compiled = re.compile(NAMED.get(pattern, pattern))
        pick = lambda path: bool(compiled.search(path))
    return jax.tree_util.tree_map_with_path(lambda p, _: pick(dotted(p)), params)


def masked(tx, trainable_mask) -> optax.GradientTransformation:
    """`tx` on the parameters the mask trains; the others get an exactly zero update and no optimizer
    state (optax.multi_transform keeps an inner state only for its own leaves)."""
    labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable_mask)
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


def optimizer(uptrain, trainable_mask) -> optax.GradientTransformation:
    """Adam at `uptrain.lr` (5 % warmup, cosine decay over the stage) on the chosen parameters, clipped
    to global norm 1 over those; the others frozen (`masked`: no update, no moments, no weight decay)."""
    steps = max(int(uptrain.transfer_steps), 1)
    # a one-step stage has no room for warmup (optax needs a decay after it)
    warmup = min(max(steps // 20, 1), steps - 1)
    lr = optax.warmup_cosine_decay_schedule(0.0, float(uptrain.lr), warmup, steps)
    return masked(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)), trainable_mask)


def stage(uptrain, abstract_params, build_softmax) -> Stage | None:
    """The attention-transfer stage of a run with `uptrain` (config.uptrain) for a model whose parameters
    are `abstract_params`; `build_softmax()` builds its softmax twin (the teacher). None when
    transfer_steps is 0."""
    steps = int(uptrain.get("transfer_steps", 0) or 0)
    if not steps:
        return None
    mask = trainable_mask(abstract_params, str(uptrain.trainable), str(uptrain.get("lora_also", "")))
    if not any(jax.tree.leaves(mask)):
        raise ConfigError("uptrain.trainable", str(uptrain.trainable),
                          "selects no parameter of this model: give 'query_key', 'all', 'feature_maps', 'lora' or a "
                          "regular expression that matches some of its dotted parameter paths")
    teacher = teacher_of(build_softmax)
    return Stage(name="transfer", steps=steps, tx=optimizer(uptrain, mask),
                 loss=partial(loss_fn, teacher=teacher), entries=lambda params: {"teacher": params},
                 entry_keys=("teacher",), evaluate=partial(layer_errors, teacher=teacher), eval_name="mse_layer",
                 summary_key="attention_mse", describe="attention MSE against softmax, per layer", trainable=mask)
