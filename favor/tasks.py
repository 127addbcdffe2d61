"""What a model is trained to do: the loss on a batch and the eval metrics, keyed by config.task.

A task has
    loss(model, batch, deterministic) -> (scalar loss, {name: scalar})      (train step)
    eval_outputs(model, batch) -> {name: array}    (eval step: sums, or per-example outputs)
    finalize([outputs of every eval batch]) -> {metric: value}               (host, after the split)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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

    def eval_outputs(self, model, batch):
        """Per-batch sums (accuracy and loss decompose over examples)."""
        logits = self._logits(model, batch, True)
        valid = batch["valid"].astype(jnp.float32)
        return {"correct": jnp.sum(valid * (jnp.argmax(logits, -1) == batch["label"])),
                "loss": jnp.sum(valid * optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])),
                "count": jnp.sum(valid)}

    @staticmethod
    def finalize(outputs):
        sums = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        n = max(sums["count"], 1.0)
        return {"accuracy": sums["correct"] / n, "loss": sums["loss"] / n}


class Glue:
    """A GLUE task on BERT: cross-entropy (or squared error for STS-B) on the pooled head; eval
    gathers every prediction of the validation split and reports the GLUE paper's metrics."""

    OPTIONS = {"task": "sst2"}

    def __init__(self, task="sst2"):
        from favor import metrics
        if task not in metrics.GLUE_METRICS:
            raise ValueError(f"unknown GLUE task {task!r}; valid: {', '.join(metrics.GLUE_METRICS)}")
        self.task, self.regression = task, task == "stsb"

    def _logits(self, model, batch, deterministic):
        out = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], deterministic=deterministic)
        return out["logits"].astype(jnp.float32)

    def _losses(self, logits, label):
        if self.regression:
            return jnp.square(logits - label)
        return optax.softmax_cross_entropy_with_integer_labels(logits, label)

    def loss(self, model, batch, deterministic=False):
        logits = self._logits(model, batch, deterministic)
        return jnp.mean(self._losses(logits, batch["label"])), {}

    def eval_outputs(self, model, batch):
        logits = self._logits(model, batch, True)
        pred = logits if self.regression else jnp.argmax(logits, -1)
        return {"pred": pred, "label": batch["label"], "valid": batch["valid"],
                "loss": self._losses(logits, batch["label"])}

    def finalize(self, outputs):
        from favor import metrics
        cat = {k: np.concatenate([np.asarray(o[k]) for o in outputs]) for k in outputs[0]}
        valid = cat["valid"].astype(bool)
        out = metrics.glue(self.task, cat["pred"], cat["label"], valid)
        out["loss"] = float(np.mean(cat["loss"][valid]))
        return out


_REGISTRY = {"classification": Classification, "glue": Glue}


def names():
    return tuple(_REGISTRY)


def get(config):
    options = dict(config)
    name = options.pop("name", None)
    return build("task", _REGISTRY, name, options)
