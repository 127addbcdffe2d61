"""Packed documents through the models: a row of several documents (segment ids, positions restarting at
each document) gives every document the logits and the loss it gets as a row of its own, for the
decoder (causal, rotary and learned positions) and BERT (bidirectional)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor import models
from favor.tasks.mlm import CausalLM

VOCAB = 64
DOCS = (11, 20, 1, 9)          # one row: four documents, then padding to LENGTH
LENGTH = 48

# one per family of the model's attention (every kind and window form is checked at the attention level in
# tests/test_documents.py): exponential features with running statistics, exact zeros, softmax, learned positions
DECODERS = {
    "favor+": ({"kind": "favor+", "num_features": 16}, {}),
    "favor#": ({"kind": "favor#", "num_features": 16}, {}),          # fitted to running statistics
    "relu": ({"kind": "relu"}, {}),
    "softmax": ({"kind": "softmax"}, {}),
    "gpt2-favor+": ({"kind": "favor+", "num_features": 16},
                    {"norm": "layer", "mlp": "gelu", "positions": "learned", "use_bias": True, "tie_embeddings": True}),
}


def packed_and_alone(seed=0):
    """(packed ids [1, L], mask, segment ids, positions), and each document's ids as a row of its own."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, VOCAB, n) for n in DOCS]
    ids = np.zeros((1, LENGTH), np.int32)
    seg = np.full((1, LENGTH), len(DOCS), np.int32)
    pos = np.zeros((1, LENGTH), np.int32)
    at = 0
    for d, doc in enumerate(docs):
        ids[0, at:at + len(doc)], seg[0, at:at + len(doc)], pos[0, at:at + len(doc)] = doc, d, np.arange(len(doc))
        at += len(doc)
    mask = np.arange(LENGTH)[None] < at
    return (ids, mask, seg, pos), docs


def decoder(spec):
    block, layout = DECODERS[spec]
    model = models.get("decoder", "tiny", rngs=nnx.Rngs(3), attention=block, vocab_size=VOCAB, hidden=32, heads=2,
                       mlp_dim=64, max_positions=64, **layout)
    if model.layers[0].attention.fit_stats is not None:     # running statistics, as a trained model has them
        model(jax.random.randint(jax.random.key(9), (4, 16), 0, VOCAB), deterministic=False)
    return model


@nnx.jit
def run(model, *args, **kwargs):
    """model(*args, **kwargs) as one compiled program per shape (eager, each operation compiles on its own)."""
    return model(*args, **kwargs)


def logits(model, ids, mask=None, segment_ids=None, positions=None):
    return run(model, ids, mask, segment_ids=segment_ids, positions=positions)["logits"]


@pytest.mark.parametrize("spec", list(DECODERS))
def test_a_packed_decoder_row_gives_each_document_its_own_logits(spec):
    model = decoder(spec)
    (ids, mask, seg, pos), docs = packed_and_alone()
    packed = np.asarray(logits(model, ids, mask, seg, pos), np.float64)
    at = 0
    for doc in docs:
        alone = np.asarray(logits(model, doc[None].astype(np.int32)), np.float64)[0]
        got = packed[0, at:at + len(doc)]
        np.testing.assert_allclose(got, alone, rtol=2e-5, atol=2e-5 * np.abs(alone).max())
        at += len(doc)
    # without segment ids the later documents see the earlier ones: the test can tell the two apart
    unpacked = np.asarray(logits(model, ids, mask), np.float64)
    assert np.abs(unpacked[0, DOCS[0]:at] - packed[0, DOCS[0]:at]).max() > 1e-3


@pytest.mark.parametrize("spec", ["favor+", "softmax"])
def test_the_first_step_loss_packed_equals_the_documents_unpacked(spec):
    """The causal_lm loss of one packed row (targets inside each document) equals the loss of the same
    documents as padded rows of their own: same targets, same mean."""
    model = decoder(spec)
    (ids, mask, seg, pos), docs = packed_and_alone(1)
    targets = np.zeros_like(ids)
    weights = np.zeros(ids.shape, np.float32)
    at = 0
    for doc in docs:       # each token but a document's last predicts the next token of its own document
        targets[0, at:at + len(doc) - 1], weights[0, at:at + len(doc) - 1] = doc[1:], 1.0
        at += len(doc)
    packed = {"input_ids": ids, "attention_mask": mask, "segment_ids": seg, "positions": pos, "targets": targets,
              "weights": weights}
    rows = np.zeros((len(docs), LENGTH), np.int32)
    row_targets, row_weights = np.zeros_like(rows), np.zeros(rows.shape, np.float32)
    for i, doc in enumerate(docs):
        rows[i, :len(doc)], row_targets[i, :len(doc) - 1], row_weights[i, :len(doc) - 1] = doc, doc[1:], 1.0
    unpacked = {"input_ids": rows, "attention_mask": np.arange(LENGTH)[None] < np.array(DOCS)[:, None],
                "targets": row_targets, "weights": row_weights}
    task = CausalLM()
    loss_packed, _ = task.loss(model, packed, deterministic=True)
    loss_rows, _ = task.loss(model, unpacked, deterministic=True)
    np.testing.assert_allclose(float(loss_packed), float(loss_rows), rtol=1e-5)


@pytest.mark.parametrize("kind", ["favor+", "softmax"])
def test_a_packed_bert_row_gives_each_document_its_own_outputs(kind):
    block = {"kind": kind} if kind == "softmax" else {"kind": kind, "num_features": 32}
    model = models.get("bert", "tiny", rngs=nnx.Rngs(0), attention=block, vocab_size=VOCAB, hidden=32, heads=2,
                       mlp_dim=64, max_positions=64, head="mlm")
    (ids, mask, seg, pos), docs = packed_and_alone(2)
    packed = np.asarray(run(model, ids, attention_mask=mask, segment_ids=seg, positions=pos)["logits"], np.float64)
    at = 0
    for doc in docs:
        alone = np.asarray(run(model, doc[None].astype(np.int32))["logits"], np.float64)[0]
        np.testing.assert_allclose(packed[0, at:at + len(doc)], alone, rtol=2e-5, atol=2e-5 * np.abs(alone).max())
        at += len(doc)


def test_positions_of_the_wrong_shape_are_refused():
    model = decoder("favor+")
    (ids, mask, seg, pos), _ = packed_and_alone()
    with pytest.raises(ValueError, match=r"positions .*\[B, L\] = \(1, 48\); got shape \(48,\)"):
        model(ids, mask, segment_ids=seg, positions=pos[0])
    with pytest.raises(ValueError, match=r"segment_ids .*\[B, L\] = \(1, 48\); got shape \(1, 47\)"):
        model(ids, mask, segment_ids=seg[:, 1:], positions=pos)
    with pytest.raises(ValueError, match=r"segment_ids must be integers .*float32"):
        model(ids, mask, segment_ids=seg.astype(np.float32), positions=pos)
