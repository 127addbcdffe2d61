"""Speech recognition with CTC (Graves et al. 2006) on the Conformer's outputs; greedy decoding, WER/CER.

Batches are favor.data.speech's: features, feature_lengths, labels (sentencepiece ids, 0-padded),
label_lengths, valid. The model (favor.models.conformer) emits vocab_size + 1 classes with 0 the blank
and sentencepiece id k at class k + 1, so the CTC labels are ids + 1 and blank_id = 0.

Loss: optax.ctc_loss per utterance (logit paddings from the model's subsampled mask, label paddings
from label_lengths), summed over the batch and divided by the number of label tokens: each token
weighs the same whatever the utterance length, and the loss reads as nats per token on any dataset.
Rows that cannot be aligned are left out (weight 0; as `zero_infinity` in other toolkits): invalid rows
(padding, utterances the data source dropped), rows without labels, and rows whose encoder frames are
fewer than CTC needs (labels + adjacent repeats, each repeat needs a blank between). optax would give
them a finite but huge loss (its log ε = −1e5) that swamps the gradient.

Evaluation: greedy decoding (per frame argmax, collapse repeats, drop blanks), ids -> text with the
sentencepiece model, then corpus WER and CER with `jiwer` (errors summed over the split / reference
words or characters). The reference is the label sequence decoded by the same tokenizer (the
transcript with whitespace normalised; identical to it when the tokenizer covers its characters,
as it does for LibriSpeech and the espeak corpus).

The tokenizer: option `tokenizer` (a sentencepiece model file) or, when empty, the one the speech data
source uses (the trainer calls `bind(source)` after building both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jiwer
import numpy as np
import optax

from favor.data import tokenizers


def ctc_inputs(labels, label_lengths):
    """(CTC labels = ids + 1 (0 at padding), label paddings [B, U] float32 1.0 = padded)."""
    labels = jnp.asarray(labels)
    padded = jnp.arange(labels.shape[1])[None, :] >= jnp.asarray(label_lengths)[:, None]
    return jnp.where(padded, 0, labels + 1), padded.astype(jnp.float32)


def alignable(labels, label_lengths, frames):
    """[B] bool: a CTC path exists, i.e. frames ≥ labels + adjacent repeats (and at least one label)."""
    labels, label_lengths = jnp.asarray(labels), jnp.asarray(label_lengths)
    inside = jnp.arange(1, labels.shape[1])[None, :] < label_lengths[:, None]
    repeats = jnp.sum(inside & (labels[:, 1:] == labels[:, :-1]), axis=1)
    return (label_lengths > 0) & (jnp.asarray(frames) >= label_lengths + repeats)


def greedy_decode(frame_ids, length) -> list[int]:
    """Best-path decoding of one utterance: the argmax classes of its first `length` frames with
    repeats collapsed and blanks (0) dropped, as sentencepiece ids (class − 1)."""
    ids = np.asarray(frame_ids)[:int(length)]
    if ids.size == 0:
        return []
    keep = np.concatenate([[True], ids[1:] != ids[:-1]]) & (ids != 0)
    return [int(i) - 1 for i in ids[keep]]


def error_rates(references: list[str], hypotheses: list[str]) -> dict[str, float]:
    """Corpus WER and CER (jiwer: substitutions + deletions + insertions over all references, divided
    by the reference words / characters). Pairs whose reference is empty are skipped (no words to
    err on; jiwer refuses them)."""
    pairs = [(r, h) for r, h in zip(references, hypotheses) if r.strip()]
    if not pairs:
        return {"wer": float("nan"), "cer": float("nan")}
    refs, hyps = [p[0] for p in pairs], [p[1] for p in pairs]
    return {"wer": float(jiwer.wer(refs, hyps)), "cer": float(jiwer.cer(refs, hyps))}


class Ctc:
    OPTIONS = {"tokenizer": ""}

    def __init__(self, tokenizer=""):
        self.tokenizer_file = str(tokenizer)
        self._tokenizer = None

    def bind(self, source):
        """Decode with the data source's tokenizer unless `tokenizer` names a model file."""
        if not self.tokenizer_file and getattr(source, "tokenizer", None) is not None:
            self._tokenizer = source.tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if not self.tokenizer_file:
                raise ValueError("ctc: task.tokenizer is empty and no speech data source was bound to the task; "
                                 "set task.tokenizer to the sentencepiece model the data uses")
            self._tokenizer = tokenizers.SentencePiece(self.tokenizer_file)
        return self._tokenizer

    def text(self, ids) -> str:
        """Sentencepiece ids -> text, leaving out ids that are not text: padding, the BERT symbols
        ([CLS] [SEP] [MASK]) and classes past the tokenizer's vocabulary (a model may have more)."""
        tok = self.tokenizer
        skip = {tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id}
        return tok.decode([int(i) for i in ids if int(i) not in skip and 0 <= int(i) < tok.vocab_size])

    def _forward(self, model, batch, deterministic):
        out = model(batch["features"], batch["feature_lengths"], deterministic=deterministic)
        logits = out["logits"].astype(jnp.float32)
        if logits.shape[-1] - 1 < self.tokenizer.vocab_size:      # trace time: a class per sentencepiece id
            raise ValueError(f"ctc: the model has {logits.shape[-1] - 1} output classes besides the blank but the "
                             f"tokenizer has {self.tokenizer.vocab_size} pieces; set model.vocab_size ≥ "
                             f"{self.tokenizer.vocab_size}")
        labels, label_paddings = ctc_inputs(batch["labels"], batch["label_lengths"])
        per = optax.ctc_loss(logits, 1.0 - out["mask"].astype(jnp.float32), labels, label_paddings)
        use = alignable(batch["labels"], batch["label_lengths"], out["lengths"])
        if "valid" in batch:
            use = use & batch["valid"].astype(bool)
        w = use.astype(jnp.float32)
        return out, jnp.where(use, per, 0.0), w, w * batch["label_lengths"].astype(jnp.float32)

    def loss(self, model, batch, deterministic=False):
        _, per, w, tokens = self._forward(model, batch, deterministic)
        loss = jnp.sum(per) / jnp.maximum(jnp.sum(tokens), 1.0)
        return loss, {"utterance_loss": jnp.sum(per) / jnp.maximum(jnp.sum(w), 1.0),
                      "aligned_fraction": jnp.mean(w)}

    def eval_outputs(self, model, batch):
        out, per, _, tokens = self._forward(model, batch, True)
        pred = jnp.where(out["mask"], jnp.argmax(out["logits"], -1), 0).astype(jnp.int32)
        return {"pred": pred, "lengths": out["lengths"], "labels": batch["labels"],
                "label_lengths": batch["label_lengths"], "valid": batch["valid"], "loss": per, "tokens": tokens}

    def finalize(self, outputs):
        refs, hyps, loss, tokens = [], [], 0.0, 0.0
        for o in outputs:                     # batches may differ in width (length buckets)
            o = jax.tree.map(np.asarray, o)
            loss += float(np.sum(o["loss"]))
            tokens += float(np.sum(o["tokens"]))
            for j in np.flatnonzero(o["valid"]):
                refs.append(self.text(o["labels"][j, :int(o["label_lengths"][j])]))
                hyps.append(self.text(greedy_decode(o["pred"][j], o["lengths"][j])))
        return {**error_rates(refs, hyps), "loss": loss / max(tokens, 1.0)}
