"""Language-model losses: masked-token prediction (BERT: cross-entropy at the masked positions only) and
next-token prediction (a causal decoder: cross-entropy at every position with a target).

Batches packed by document (favor.data.text, data.packing="documents") carry segment_ids and positions,
which both pass to the model as keyword arguments; a batch without them calls the model exactly as
before, so models and sources that know nothing of documents are unchanged."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

DOCUMENT_KEYS = ("segment_ids", "positions")


def document_inputs(batch) -> dict:
    """The batch's document keys (segment_ids, positions) it has, as the model's keyword arguments."""
    return {k: batch[k] for k in DOCUMENT_KEYS if k in batch}


class MaskedLM:
    """Batches from favor.data.text: the model's MLM head runs at `mlm_positions`; the loss is the mean
    cross-entropy over real targets (`mlm_weights`); metrics accuracy and, in eval, perplexity."""

    OPTIONS: dict = {}

    def _losses(self, model, batch, deterministic):
        out = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                    deterministic=deterministic, mlm_positions=batch["mlm_positions"], **document_inputs(batch))
        logits = out["logits"].astype(jnp.float32)
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["mlm_ids"])
        correct = (jnp.argmax(logits, -1) == batch["mlm_ids"]).astype(jnp.float32)
        return xent, correct, batch["mlm_weights"].astype(jnp.float32)

    def loss(self, model, batch, deterministic=False):
        xent, correct, w = self._losses(model, batch, deterministic)
        n = jnp.maximum(jnp.sum(w), 1.0)
        return jnp.sum(w * xent) / n, {"accuracy": jnp.sum(w * correct) / n}

    def eval_outputs(self, model, batch):
        xent, correct, w = self._losses(model, batch, True)
        w = w * batch["valid"].astype(jnp.float32)[:, None]
        return {"loss": jnp.sum(w * xent), "correct": jnp.sum(w * correct), "count": jnp.sum(w)}

    @staticmethod
    def finalize(outputs):
        sums = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        n = max(sums["count"], 1.0)
        loss = sums["loss"] / n
        return {"loss": loss, "accuracy": sums["correct"] / n, "perplexity": float(np.exp(min(loss, 50.0)))}


class CausalLM(MaskedLM):
    """Batches from favor.data.text.CausalText: the decoder's logits at every position against the next
    token (`targets`), weighted by `weights`; metrics token accuracy and, in eval, perplexity."""

    def _losses(self, model, batch, deterministic):
        out = model(batch["input_ids"], batch["attention_mask"], deterministic=deterministic, **document_inputs(batch))
        logits = out["logits"].astype(jnp.float32)
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
        return xent, correct, batch["weights"].astype(jnp.float32)
