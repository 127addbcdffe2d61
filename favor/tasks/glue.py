"""GLUE fine-tuning on BERT, reporting each task's GLUE-paper metrics."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from favor.tasks import metrics


class Glue:
    """A GLUE task on BERT: cross-entropy (or squared error for STS-B) on the pooled head; eval
    gathers every prediction of the validation split and reports the GLUE paper's metrics."""

    OPTIONS = {"task": "sst2"}

    def __init__(self, task="sst2"):
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
        cat = {k: np.concatenate([np.asarray(o[k]) for o in outputs]) for k in outputs[0]}
        valid = cat["valid"].astype(bool)
        out = metrics.glue(self.task, cat["pred"], cat["label"], valid)
        out["loss"] = float(np.mean(cat["loss"][valid]))
        return out
