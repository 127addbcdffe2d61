"""Image (or any input) classification: softmax cross-entropy; accuracy, and top-5 accuracy in eval
when there are at least 5 classes (ImageNet reports top-1 and top-5). `input`: the batch key the model
reads ("image"), or "text": a token classifier's (input_ids, token_type_ids, attention_mask)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


class Classification:
    """Softmax cross-entropy over `logits` against `label`: integer class ids [B], or soft targets
    [B, num_classes] (mixup / CutMix) whose rows sum to 1. Label smoothing mixes the target with the
    uniform distribution, (1 − ε)·y + ε/K; it is affine, so smoothing a mixed target equals mixing
    smoothed ones. Accuracy counts argmax(logits) == the label (a soft label's argmax: its larger part)."""

    OPTIONS = {"input": "image", "label_smoothing": 0.0}

    def __init__(self, input="image", label_smoothing=0.0):
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(f"classification: label_smoothing must be in [0, 1); got {label_smoothing!r}")
        self.input, self.label_smoothing = input, float(label_smoothing)

    def _logits(self, model, batch, deterministic):
        if self.input == "text":
            out = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], deterministic=deterministic)
        else:
            out = model(batch[self.input], deterministic=deterministic)
        return out["logits"].astype(jnp.float32)

    @staticmethod
    def _targets(labels, num_classes):
        """(soft targets [B, K], class ids [B]) from integer or soft labels (shapes are static: checked
        at trace time)."""
        if labels.ndim == 2:
            if labels.shape[-1] != num_classes:
                raise ValueError(f"classification: soft labels have {labels.shape[-1]} classes but the model's "
                                 f"logits have {num_classes} (set model.num_classes to the dataset's)")
            return labels.astype(jnp.float32), jnp.argmax(labels, -1)
        if labels.ndim != 1:
            raise ValueError(f"classification: labels must be [batch] class ids or [batch, classes] soft "
                             f"targets; got shape {labels.shape}")
        return jax.nn.one_hot(labels, num_classes), labels

    def _xent(self, logits, labels, smoothing):
        targets, ids = self._targets(labels, logits.shape[-1])
        if smoothing:
            targets = optax.smooth_labels(targets, smoothing)
        return optax.softmax_cross_entropy(logits, targets), ids

    def loss(self, model, batch, deterministic=False):
        logits = self._logits(model, batch, deterministic)
        xent, ids = self._xent(logits, batch["label"], self.label_smoothing)
        acc = jnp.mean((jnp.argmax(logits, -1) == ids).astype(jnp.float32))
        return jnp.mean(xent), {"accuracy": acc}

    def eval_outputs(self, model, batch):
        """Per-batch sums (accuracy and loss decompose over examples); the loss is unsmoothed."""
        logits = self._logits(model, batch, True)
        valid = batch["valid"].astype(jnp.float32)
        xent, ids = self._xent(logits, batch["label"], 0.0)
        out = {"correct": jnp.sum(valid * (jnp.argmax(logits, -1) == ids)), "loss": jnp.sum(valid * xent),
               "count": jnp.sum(valid)}
        if logits.shape[-1] >= 5:
            top5 = jax.lax.top_k(logits, 5)[1]
            out["correct_top5"] = jnp.sum(valid * jnp.any(top5 == ids[:, None], axis=-1))
        return out

    @staticmethod
    def finalize(outputs):
        sums = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        n = max(sums["count"], 1.0)
        out = {"accuracy": sums["correct"] / n, "loss": sums["loss"] / n}
        if "correct_top5" in sums:
            out["top5_accuracy"] = sums["correct_top5"] / n
        return out
