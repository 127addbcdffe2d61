"""Packed documents in the text pipelines (data.packing): segment_ids and positions of causal and masked
rows against plain-Python references, on streams with end-of-text tokens where the test puts them; the
"stream" packing unchanged; the defaults; a bad value; and the LM tasks passing the keys only when a
batch has them."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from favor import data
from favor.data import text
from favor.tasks import mlm

WORDS = "the model reads every token of the text and predicts the next one".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, CLS, SEP = 0, 2, 3
L = 8
OLD_CAUSAL_KEYS = {"input_ids", "attention_mask", "targets", "weights"}
OLD_MASKED_KEYS = {"input_ids", "token_type_ids", "attention_mask", "mlm_positions", "mlm_ids", "mlm_weights"}

# causal rows of L = 8 inputs (the stream's tokens [8i, 8i + 8), each predicting the token after it)
CAUSAL_STREAM = [5, 6, 7, SEP, 8, 9, SEP, SEP,          # two documents end, then an empty one (two [SEP]s)
                 SEP, 5, 6, 7, 8, 9, 10, 11,            # a row that opens with a [SEP]
                 12, 13, SEP, 5, 6, SEP, 7, 8,
                 9, 10, SEP, 5, 6]                      # the last row: 4 inputs, then padding
# masked rows: [CLS] + 6 stream tokens + [SEP]
MASKED_STREAM = [5, SEP, 6, 7, SEP, 8,
                 SEP, SEP, 9, 10, 11, SEP,              # opens with two [SEP]s, ends with one
                 12, 5]                                 # the last row: padded


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A files: corpus and a WordPiece vocabulary with BERT's symbols ([SEP] = 3): every source here
    builds offline in well under a second. Returns the options every text source takes."""
    root = tmp_path_factory.mktemp("packing")
    (root / "vocab.txt").write_text("\n".join(SPECIAL + sorted(set(WORDS))) + "\n")
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, int(rng.integers(2, 12)))) for _ in range(30)]
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    return {"dataset": f"files:{root / 'docs.jsonl'}", "train_split": "train", "eval_split": "train[-3:]",
            "data_dir": str(root / "cache"), "tokenizer": f"wordpiece:{root / 'vocab.txt'}", "max_length": L,
            "max_eval_rows": 0}


def with_stream(source, stream):
    """The source reading `stream` as its training split (the token array its rows are cut from)."""
    source.tokens["train"] = np.asarray(stream, np.uint16)
    return source


def read_all(source):
    n = source.num_train
    return source.read("train", np.arange(n), np.arange(n), [np.random.default_rng(i) for i in range(n)])


def layout_reference(segments, length):
    """(segment ids, positions) of a row from the segment count of each real token, as the task states them:
    ids shifted to start at 0, a position counting from the segment's first token in the row, padding one
    id past the last real one at position 0."""
    segments = [s - segments[0] for s in segments]
    positions = [t - segments.index(s) for t, s in enumerate(segments)]
    pad = length - len(segments)
    return segments + [segments[-1] + 1] * pad, positions + [0] * pad


def causal_reference(stream, row):
    """segment(t) = the number of [SEP]s at input positions ≤ t of the row."""
    inputs = stream[row * L:min((row + 1) * L, len(stream) - 1)]
    return layout_reference([sum(1 for x in inputs[:t + 1] if x == SEP) for t in range(len(inputs))], L)


def masked_reference(stream, row):
    """Row [CLS] chunk [SEP]: segment(t) = the number of the chunk's [SEP]s at row positions < t."""
    width = L - 2
    chunk = stream[row * width:(row + 1) * width]
    full = [CLS, *chunk, SEP]
    counts = [sum(1 for j in range(1, min(t, len(chunk) + 1)) if full[j] == SEP) for t in range(len(full))]
    return layout_reference(counts, L)


def test_causal_documents_match_the_reference_and_the_hand_worked_rows(corpus):
    source = with_stream(text.CausalText(**corpus), CAUSAL_STREAM)
    assert source.packing == "documents" and source.num_train == 4
    batch = read_all(source)
    assert set(batch) == OLD_CAUSAL_KEYS | {"segment_ids", "positions"}
    assert batch["segment_ids"].dtype == np.int32 and batch["positions"].dtype == np.int32
    for row in range(4):
        want_seg, want_pos = causal_reference(CAUSAL_STREAM, row)
        np.testing.assert_array_equal(batch["segment_ids"][row], want_seg, err_msg=f"row {row}")
        np.testing.assert_array_equal(batch["positions"][row], want_pos, err_msg=f"row {row}")
    # worked by hand: each [SEP] begins the next document, the second of two is a one-token document
    np.testing.assert_array_equal(batch["segment_ids"][0], [0, 0, 0, 1, 1, 1, 2, 3])
    np.testing.assert_array_equal(batch["positions"][0], [0, 1, 2, 0, 1, 2, 0, 0])
    # a row opening with [SEP]: that token begins its first document, id 0
    np.testing.assert_array_equal(batch["segment_ids"][1], np.zeros(L))
    np.testing.assert_array_equal(batch["positions"][1], np.arange(L))
    # padding: one id past the last document's, position 0
    np.testing.assert_array_equal(batch["attention_mask"][3], [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["segment_ids"][3], [0, 0, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(batch["positions"][3], [0, 1, 0, 1, 0, 0, 0, 0])


def test_every_causal_target_is_predicted_from_its_own_document(corpus):
    """What a model that attends within a segment sees at input t: the stream from the document's first
    token (its opening [SEP], or the row's start when the row cut it) to t, and it predicts the stream's
    next token. So a document's last token predicts its [SEP] from its own document, and a [SEP] predicts
    the next document's first token from itself alone."""
    source = with_stream(text.CausalText(**corpus), CAUSAL_STREAM)
    batch = read_all(source)
    seg, pos, ids = batch["segment_ids"], batch["positions"], batch["input_ids"]
    for row in range(source.num_train):
        for t in np.flatnonzero(batch["weights"][row] > 0):
            g = row * L + t                                   # the input's place in the stream
            begin = max([row * L] + [j for j in range(row * L, g + 1) if CAUSAL_STREAM[j] == SEP])
            visible = [int(ids[row, u]) for u in range(t + 1) if seg[row, u] == seg[row, t]]
            assert visible == CAUSAL_STREAM[begin:g + 1], (row, t)
            assert batch["targets"][row, t] == CAUSAL_STREAM[g + 1]
            assert list(pos[row, [u for u in range(t + 1) if seg[row, u] == seg[row, t]]]) == list(range(len(visible)))
            if CAUSAL_STREAM[g] == SEP:
                assert visible == [SEP]
        real = batch["attention_mask"][row] > 0
        assert not np.isin(seg[row, ~real], seg[row, real]).any()     # padding shares no real token's id


def test_causal_documents_on_a_packed_corpus(corpus):
    """The stream favor packed from the files (a [SEP] after each document), every row against the reference."""
    source = text.CausalText(**corpus)
    stream = [int(x) for x in source.tokens["train"]]
    assert stream.count(SEP) == 30
    batch = read_all(source)
    for row in range(source.num_train):
        want_seg, want_pos = causal_reference(stream, row)
        np.testing.assert_array_equal(batch["segment_ids"][row], want_seg)
        np.testing.assert_array_equal(batch["positions"][row], want_pos)


def test_stream_packing_is_todays_batch(corpus):
    documents = read_all(with_stream(text.CausalText(**corpus), CAUSAL_STREAM))
    source = with_stream(text.CausalText(**corpus, packing="stream"), CAUSAL_STREAM)
    batch = read_all(source)
    assert set(batch) == OLD_CAUSAL_KEYS
    for k in OLD_CAUSAL_KEYS:
        np.testing.assert_array_equal(batch[k], documents[k])
    s = np.asarray(CAUSAL_STREAM)
    for row in range(source.num_train):
        n = min(L, len(s) - 1 - row * L)
        want_ids = np.full(L, PAD)
        want_ids[:n] = s[row * L:row * L + n]
        want_tgt = np.full(L, PAD)
        want_tgt[:n] = s[row * L + 1:row * L + n + 1]
        np.testing.assert_array_equal(batch["input_ids"][row], want_ids)
        np.testing.assert_array_equal(batch["targets"][row], want_tgt)
        np.testing.assert_array_equal(batch["weights"][row], np.arange(L) < n)
        np.testing.assert_array_equal(batch["attention_mask"][row], np.arange(L) < n)


def test_masked_text_defaults_to_stream_and_packs_documents_when_asked(corpus):
    stream_src = with_stream(text.MaskedText(**corpus), MASKED_STREAM)
    assert stream_src.packing == "stream"
    plain = read_all(stream_src)
    assert set(plain) == OLD_MASKED_KEYS
    source = with_stream(text.MaskedText(**corpus, packing="documents"), MASKED_STREAM)
    batch = read_all(source)
    assert set(batch) == OLD_MASKED_KEYS | {"segment_ids", "positions"}
    for k in OLD_MASKED_KEYS:                 # the same rows and the same masking: only the two keys are new
        np.testing.assert_array_equal(batch[k], plain[k])
    assert source.num_train == 3
    for row in range(3):
        want_seg, want_pos = masked_reference(MASKED_STREAM, row)
        np.testing.assert_array_equal(batch["segment_ids"][row], want_seg, err_msg=f"row {row}")
        np.testing.assert_array_equal(batch["positions"][row], want_pos, err_msg=f"row {row}")
    # [CLS] 5 [SEP] | 6 7 [SEP] | 8 [SEP]: the [CLS] opens the first document, the final [SEP] closes the last
    np.testing.assert_array_equal(batch["segment_ids"][0], [0, 0, 0, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(batch["positions"][0], [0, 1, 2, 0, 1, 2, 0, 1])
    # [CLS] [SEP] | [SEP] | 9 10 11 [SEP] | [SEP]: after a chunk ending in [SEP] the final one stands alone
    np.testing.assert_array_equal(batch["segment_ids"][1], [0, 0, 1, 2, 2, 2, 2, 3])
    np.testing.assert_array_equal(batch["positions"][1], [0, 1, 0, 0, 1, 2, 3, 0])
    # [CLS] 12 5 [SEP] then padding
    np.testing.assert_array_equal(batch["segment_ids"][2], [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(batch["positions"][2], [0, 1, 2, 3, 0, 0, 0, 0])
    # masking never touches a [SEP], so the masked ids still mark where documents end
    ids = batch["input_ids"]
    assert np.all((ids == SEP) == (plain["input_ids"] == SEP))


def test_defaults_by_data_name_and_a_bad_value(corpus):
    assert text.CausalText.OPTIONS["packing"] == "documents" and text.MaskedText.OPTIONS["packing"] == "stream"
    block = {k: v for k, v in corpus.items()}
    assert data.get({"name": "causal_text", **block}).packing == "documents"
    assert data.get({"name": "text", **block}).packing == "stream"
    assert data.get({"name": "causal_text", **block, "packing": "stream"}).packing == "stream"
    for cls, name in ((text.CausalText, "causal_text"), (text.MaskedText, "text")):
        with pytest.raises(ValueError, match=r"^text: packing must be one of 'documents', 'stream'; got 'doc'$"):
            cls(**corpus, packing="doc")
        with pytest.raises(ValueError, match="packing must be one of"):
            data.get({"name": name, **block, "packing": "Documents"})


def test_document_keys_travel_through_the_eval_and_train_streams(corpus):
    source = with_stream(text.CausalText(**corpus), CAUSAL_STREAM)
    train = next(source.train_batches(4, 0, 0))
    evals = list(source.eval_batches(4))
    for batch in (train, *evals):
        assert {"segment_ids", "positions"} <= set(batch)
        assert batch["segment_ids"].shape == batch["input_ids"].shape == batch["positions"].shape


class StandIn:
    """A model that records the keyword arguments it was called with and returns constant logits."""

    def __init__(self, vocab=16):
        self.vocab, self.calls = vocab, []

    def __call__(self, input_ids, *args, **kwargs):
        self.calls.append(kwargs)
        return {"logits": jnp.zeros((*kwargs.get("mlm_positions", input_ids).shape, self.vocab))}


def test_tasks_pass_the_document_keys_only_when_the_batch_has_them():
    b = 2
    causal = {"input_ids": jnp.ones((b, L), jnp.int32), "attention_mask": jnp.ones((b, L), jnp.int32),
              "targets": jnp.ones((b, L), jnp.int32), "weights": jnp.ones((b, L), jnp.float32)}
    masked = {"input_ids": jnp.ones((b, L), jnp.int32), "token_type_ids": jnp.zeros((b, L), jnp.int32),
              "attention_mask": jnp.ones((b, L), jnp.int32), "mlm_positions": jnp.ones((b, 3), jnp.int32),
              "mlm_ids": jnp.ones((b, 3), jnp.int32), "mlm_weights": jnp.ones((b, 3), jnp.float32)}
    docs = {"segment_ids": jnp.zeros((b, L), jnp.int32), "positions": jnp.tile(jnp.arange(L), (b, 1))}
    for task, batch in ((mlm.CausalLM(), causal), (mlm.MaskedLM(), masked)):
        model = StandIn()
        loss, _ = task.loss(model, batch)
        assert np.isclose(float(loss), np.log(16))
        assert "segment_ids" not in model.calls[-1] and "positions" not in model.calls[-1]
        task.loss(model, {**batch, **docs})
        assert model.calls[-1]["segment_ids"] is docs["segment_ids"]
        assert model.calls[-1]["positions"] is docs["positions"]
        task.eval_outputs(model, {**batch, **docs, "valid": jnp.ones(b, bool)})
        assert model.calls[-1]["segment_ids"] is docs["segment_ids"]


def test_train_py_names_a_bad_packing_in_one_line(tmp_path):
    """A bad data.packing stops train.py before anything is read or written: one line, exit 2."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "train.py", "--config", "configs/decoder_lm.py:runlocal", "--workdir",
                           str(tmp_path / "run"), "--config.data.packing=doc"], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "error: config.data.packing='doc': must be one of 'documents', 'stream'"
    assert not (tmp_path / "run").exists()
