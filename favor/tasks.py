"""What a model is trained to do: the loss on a batch and the eval metrics, keyed by config.task.

A task has
    loss(model, batch, deterministic) -> (scalar loss, {name: scalar})      (train step)
    eval_sums(model, batch) -> {name: sum over the valid rows}              (eval step)
    finalize(sums) -> {metric: value}                                       (host, after the split)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from favor.registry import build


class Classification:
    """Softmax cross-entropy over `logits` for integer `label`; metrics accuracy and loss."""

    OPTIONS = {"input": "image", "label_smoothing": 0.0}

    def __init__(self, input="image", label_smoothing=0.0):
        self.input, self.label_smoothing = input, float(label_smoothing)

    def _logits(self, model, batch, deterministic):
        return model(batch[self.input], deterministic=deterministic)["logits"].astype(jnp.float32)

    def _xent(self, logits, labels):
        targets = jax.nn.one_hot(labels, logits.shape[-1])
        if self.label_smoothing:
            targets = optax.smooth_labels(targets, self.label_smoothing)
        return optax.softmax_cross_entropy(logits, targets)

    def loss(self, model, batch, deterministic=False):
        logits = self._logits(model, batch, deterministic)
        loss = jnp.mean(self._xent(logits, batch["label"]))
        acc = jnp.mean((jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32))
        return loss, {"accuracy": acc}

    def eval_sums(self, model, batch):
        logits = self._logits(model, batch, True)
        valid = batch["valid"].astype(jnp.float32)
        return {"correct": jnp.sum(valid * (jnp.argmax(logits, -1) == batch["label"])),
                "loss": jnp.sum(valid * optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])),
                "count": jnp.sum(valid)}

    @staticmethod
    def finalize(sums):
        n = max(float(sums["count"]), 1.0)
        return {"accuracy": float(sums["correct"]) / n, "loss": float(sums["loss"]) / n}


_REGISTRY = {"classification": Classification}


def names():
    return tuple(_REGISTRY)


def get(config):
    options = dict(config)
    name = options.pop("name", None)
    return build("task", _REGISTRY, name, options)
