"""The optimizer from `config.optim`: AdamW with warmup + cosine/linear/constant decay, gradient
clipping, a weight-decay mask, and layer-wise learning-rate decay (ViT/BERT fine-tuning).

    optim.name          "adamw" | "sgd"
    optim.lr            peak learning rate
    optim.schedule      "cosine" | "linear" | "constant" (after `warmup_steps` of linear warmup)
    optim.weight_decay  decoupled; applied to matrices and embeddings only (not biases or norms)
    optim.clip_norm     global-norm clipping (0 = off)
    optim.layer_decay   1.0 = off; else layer i of n gets lr · layer_decay^(n + 1 − i) (embeddings i = 0,
                        head i = n + 1), as in BEiT / MAE fine-tuning
    optim.b1, optim.b2, optim.eps
    optim.warmup_steps, optim.end_lr_factor (the decay's final lr / lr)
    optim.accumulate_steps  microbatches per step (the trainer's scan; the update of the whole batch)
    optim.momentum      sgd only (0.9 when absent)

configs build the block with favor.config.blocks.optim (the shared defaults); `check` checks every value's
range before a run (favor.job.validate).
"""

from __future__ import annotations

import re

import jax
import optax

from favor.config.blocks import OPTIM_DEFAULTS, OPTIM_OPTIONAL
from favor.config.checks import ConfigError, integer, number, one_of

SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "sgd")


def check(config) -> int:
    """Every `config.optim` value in its range (ConfigError naming the first that is not); returns the
    microbatches per step (`accumulate_steps`), which the batch checks need."""
    o = "optim."
    one_of(config, o + "name", OPTIMIZERS)
    one_of(config, o + "schedule", SCHEDULES)
    number(config, o + "lr", lambda v: v > 0, "must be a finite number > 0")
    integer(config, o + "warmup_steps", 0)
    number(config, o + "weight_decay", lambda v: v >= 0, "must be a finite number ≥ 0")
    number(config, o + "clip_norm", lambda v: v >= 0, "must be a finite number ≥ 0 (0: no clipping)")
    number(config, o + "layer_decay", lambda v: 0 < v <= 1, "must be in (0, 1] (1: off)")
    for key in ("b1", "b2"):
        number(config, o + key, lambda v: 0 <= v < 1, "must be in [0, 1)")
    number(config, o + "eps", lambda v: v > 0, "must be a finite number > 0")
    if "end_lr_factor" in config.optim:
        number(config, o + "end_lr_factor", lambda v: 0 <= v <= 1, "must be in [0, 1]")
    if "momentum" in config.optim:
        number(config, o + "momentum", lambda v: 0 <= v < 1, "must be in [0, 1)")
    unknown = sorted(set(config.optim) - set(OPTIM_DEFAULTS) - set(OPTIM_OPTIONAL))
    if unknown:
        raise ConfigError(o + unknown[0], config.optim[unknown[0]], f"is not an optimizer key; valid: "
                          f"{', '.join([*OPTIM_DEFAULTS, *OPTIM_OPTIONAL])}")
    return integer(config, o + "accumulate_steps", 1)


def schedule(o, total_steps: int):
    if o.schedule not in SCHEDULES:
        raise ValueError(f"unknown optim.schedule {o.schedule!r}; valid: {', '.join(SCHEDULES)}")
    warmup = min(int(o.warmup_steps), max(total_steps - 1, 0))
    decay = max(total_steps - warmup, 1)
    end = o.lr * o.get("end_lr_factor", 0.0)
    after = {"cosine": optax.cosine_decay_schedule(o.lr, decay, alpha=o.get("end_lr_factor", 0.0)),
             "linear": optax.linear_schedule(o.lr, end, decay),
             "constant": optax.constant_schedule(o.lr)}[o.schedule]
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup), after], [warmup])


def decay_mask(params):
    """Weight decay on ≥ 2-D parameters (kernels, embeddings), not on biases and norm scales."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def layer_ids(params, num_layers: int):
    """Depth of each parameter: 0 for embeddings, i + 1 for block i, num_layers + 1 for the rest
    (final norm, pooler, heads)."""
    def depth(path):
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        joined = ".".join(keys)
        m = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", joined)
        if m:
            return int(m.group(1)) + 1
        if re.search(r"embed|cls_token|subsampl", joined):
            return 0
        return num_layers + 1
    return jax.tree_util.tree_map_with_path(lambda path, _: depth(path), params)


def make(o, total_steps: int, params=None, num_layers: int | None = None):
    """(optax transformation, learning-rate schedule)."""
    if o.name not in OPTIMIZERS:
        raise ValueError(f"unknown optim.name {o.name!r}; valid: {', '.join(OPTIMIZERS)}")
    lr = schedule(o, total_steps)
    parts = []
    if o.clip_norm:
        parts.append(optax.clip_by_global_norm(o.clip_norm))
    if o.name == "adamw":
        parts.append(optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask))
    else:
        parts.append(optax.sgd(lr, momentum=o.get("momentum", 0.9)))
    if o.layer_decay != 1.0:
        if params is None or num_layers is None:
            raise ValueError("optim.layer_decay needs the parameter tree and the number of layers")
        ids = layer_ids(params, num_layers)
        labels = jax.tree.map(lambda i: f"depth{i}", ids)
        scales = {f"depth{i}": optax.scale(o.layer_decay ** (num_layers + 1 - i)) for i in range(num_layers + 2)}
        parts.append(optax.multi_transform(scales, labels))
    return optax.chain(*parts), lr
