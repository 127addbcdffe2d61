"""MLM pretraining data: the docstring corpus, sentencepiece training, packing, BERT masking, resumable
streams, the TFDS text pipeline under mock data, and a tiny pretraining run whose loss falls."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from favor import job
from favor.data import local, text, tokenizers
from favor.data.source import open_tfds

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import bert_pretrain  # noqa: E402


@pytest.fixture(scope="module")
def cache(docstrings_cache):
    return docstrings_cache


@pytest.fixture(scope="module")
def source(cache):
    return text.MaskedText(dataset="local", train_split="train", eval_split="validation", vocab_size=300,
                           tokenizer_sample=1500, max_length=64, max_documents=300, max_eval_rows=16)


def test_docstring_corpus_is_real_text_split_by_module(cache):
    from favor.data import docstrings
    train = open_tfds("favor_docstrings", "train", str(cache))
    val = open_tfds("favor_docstrings", "validation", str(cache))
    assert len(train) > 2000 and len(val) > 50
    held_out = {m for m, _ in docstrings.stdlib_files() if docstrings.split_of(m) == "validation"}
    owner = lambda title: next((title[:i] for i in range(len(title), 0, -1)
                                if title[:i] in held_out and title[i:i + 1] in ("", ".")), None)
    assert all(owner(val[i]["title"].decode()) for i in range(len(val)))        # validation: held-out modules
    assert not any(owner(train[i]["title"].decode()) for i in range(0, len(train), 7))
    doc = train[0]["text"].decode()
    assert len(doc) >= 40 and " " in doc


def test_sentencepiece_tokenizer_reserves_the_bert_symbols(source):
    tok = source.tokenizer
    assert (tok.pad_id, tok.sp.unk_id(), tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert 100 < tok.vocab_size <= 300
    ids = tok.ids(["Return a new list containing all items."])[0]
    assert {tok.cls_id, tok.sep_id, tok.mask_id}.isdisjoint(ids)
    assert tok.decode(ids) == "Return a new list containing all items."
    # the symbols are never split even when they appear literally
    assert tok.ids(["[MASK]"])[0][-1] == tok.mask_id


def test_packed_rows_reassemble_the_token_stream(source):
    stream = np.asarray(source.tokens["train"])
    n = source.num_train
    assert n == math.ceil(len(stream) / 62)
    batch = source.read("eval", np.arange(3), np.arange(3), None)      # eval split: just to get rows
    rows = source.read("train", np.arange(n), np.arange(n), [np.random.default_rng(i) for i in range(n)])
    ids, w, pos, tgt = rows["input_ids"], rows["mlm_weights"], rows["mlm_positions"], rows["mlm_ids"]
    # undo the masking: put the targets back, then the rows are [CLS] chunk [SEP] of the stream
    for i in range(n):
        k = int(w[i].sum())
        ids[i, pos[i, :k]] = tgt[i, :k]
    tok = source.tokenizer
    assert np.all(ids[:, 0] == tok.cls_id)
    body = [r[1:int(m.sum()) - 1] for r, m in zip(ids, rows["attention_mask"])]
    assert all(r[int(m.sum()) - 1] == tok.sep_id for r, m in zip(ids, rows["attention_mask"]))
    np.testing.assert_array_equal(np.concatenate(body), stream)
    assert batch["input_ids"].shape == (3, 64) and np.all(batch["token_type_ids"] == 0)


def test_bert_masking_rates_match_80_10_10():
    """Over many rows: exactly ⌈15 % · n⌉ targets per row, never [CLS]/[SEP]; of the targets 80 % become
    [MASK], 10 % a random non-special token, 10 % stay (5 standard errors)."""
    rng = np.random.default_rng(0)
    vocab, mask_id = 1000, 4
    random_ids = np.arange(5, vocab)
    counts = np.zeros(3)
    for r in range(400):
        row = rng.integers(5, vocab, size=128)
        row[0], row[-1], row[50] = 2, 3, 3
        original = row.copy()
        cand = np.setdiff1d(np.arange(1, 127), [50])
        pos, tgt, w = text.mask_row(row, cand, np.random.default_rng([1, r]), 0.15, 21, mask_id, random_ids)
        k = int(w.sum())
        assert k == math.ceil(0.15 * len(cand)) and np.all(w[k:] == 0)
        assert set(pos[:k]).issubset(cand) and len(set(pos[:k])) == k
        np.testing.assert_array_equal(tgt[:k], original[pos[:k]])
        changed = row[pos[:k]]
        is_mask = changed == mask_id
        kept = ~is_mask & (changed == original[pos[:k]])
        counts += [is_mask.sum(), (~is_mask & ~kept).sum(), kept.sum()]
        untouched = np.setdiff1d(np.arange(128), pos[:k])
        np.testing.assert_array_equal(row[untouched], original[untouched])
    total = counts.sum()
    # a random replacement equals the original with probability 1/995: it counts as "kept"
    p = np.array([0.8, 0.1 * (1 - 1 / 995), 0.1 + 0.1 / 995])
    se = np.sqrt(p * (1 - p) / total)
    np.testing.assert_array_less(np.abs(counts / total - p), 5 * se)


def test_stream_resumes_where_it_stopped_and_covers_each_epoch_once(source):
    b, seed = 8, 3
    first = source.train_batches(b, 0, seed)
    uninterrupted = [next(first) for _ in range(6)]
    resumed = source.train_batches(b, 4, seed)            # a restart at step 4
    for want in uninterrupted[4:]:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])  # same rows and the same masking
    n = source.num_train
    steps = -(-n // b)                                     # the last step crosses into epoch 1
    stream = np.concatenate([source.train_indices(b, s, seed) for s in range(steps)])
    np.testing.assert_array_equal(np.sort(stream[:n]), np.arange(n))   # epoch 0: every row once
    np.testing.assert_array_equal(stream[n:], source._epoch_order(seed, 1)[:steps * b - n])
    assert not np.array_equal(source._epoch_order(seed, 0), source._epoch_order(seed, 1))


def test_eval_masking_is_fixed_and_padding_rows_are_invalid(source):
    a = list(source.eval_batches(6))
    b = list(source.eval_batches(6))
    assert source.num_eval == 16 and len(a) == 3
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"])
    np.testing.assert_array_equal(a[-1]["valid"], [True] * 4 + [False] * 2)


def test_wikipedia_pipeline_under_tfds_mock_data(tmp_path, monkeypatch):
    """The default (tfds) data block of configs/bert_pretrain.py, on mock `wikipedia` records."""
    monkeypatch.setenv("FAVOR_DATA_DIR", str(tmp_path))
    c = bert_pretrain.get_config()
    opts = dict(c.data)
    opts.pop("name")
    opts.update(vocab_size=60, tokenizer_sample=50, max_length=16, max_eval_rows=4)
    with tfds.testing.mock_data(num_examples=50, policy=tfds.testing.MockPolicy.USE_CODE):
        src = text.MaskedText(**opts)
    batch = next(src.train_batches(4, 0, 0))
    assert batch["input_ids"].shape == (4, 16) and batch["mlm_positions"].shape == (4, 4)
    assert len(list((tmp_path / "favor_tokenizers").glob("wikipedia_20230601.en-60-*.model"))) == 1


def test_missing_data_dir_and_unprepared_dataset_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*tfds build wikipedia"):
        text.MaskedText(dataset="wikipedia/20230601.en", data_dir=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not prepared.*file_format=array_record"):
        text.MaskedText(dataset="wikipedia/20230601.en", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown local corpus 'books'; valid: docstrings, speech"):
        local.prepare("books")


def test_tiny_pretraining_run_lowers_the_mlm_loss(cache, tmp_path):
    config = bert_pretrain.get_config("runlocal")
    summary = job.run(config, tmp_path)
    losses = [loss for _, loss in summary["train_loss_history"]]
    # from ≈ ln(vocab) at initialisation to clearly below it (the unigram distribution alone gives ~1 nat)
    assert losses[0] > math.log(300) - 0.5 and losses[-1] < losses[0] - 0.5
    assert summary["step"] == 40 and np.isfinite(summary["perplexity"]) and 0 <= summary["accuracy"] <= 1
    config.model.vocab_size = 100
    with pytest.raises(ValueError, match="vocab_size 100 is smaller than the tokenizer's"):
        job.run(config, tmp_path / "small_vocab")


def test_tokenizer_command_trains_a_model(cache, tmp_path):
    text.main(["tokenizer", "--dataset", "local", "--vocab_size", "200", "--sample", "500",
               "--output", str(tmp_path / "sp.model")])
    tok = tokenizers.get(f"sentencepiece:{tmp_path / 'sp.model'}")
    assert tok.mask_id == 4 and tok.vocab_size <= 200


TRAIN_IN_A_PROCESS = """
import json, sys
import numpy as np
from favor.data import tokenizers
rng = np.random.default_rng(0)
words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma"]
texts = [" ".join(rng.choice(words, 8)) + f" item{i % 97}" for i in range(3000)]
sp = tokenizers.train_sentencepiece(texts, sys.argv[1], 60, max_sentences=200).sp
print(json.dumps([(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]))
"""


def test_sentencepiece_training_is_reproducible_when_it_samples(tmp_path):
    """More lines than max_sentences: favor samples them with a seeded generator, so two processes (two
    hosts, or a rerun) train the same model. sentencepiece's own sampling is seeded per process: left
    to it, the two vocabularies differ (checked when this was written)."""
    import subprocess
    runs = [subprocess.run([sys.executable, "-c", TRAIN_IN_A_PROCESS, str(tmp_path / name)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120) for name in ("a.model", "b")]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout) > 100
    assert (tmp_path / "b.model").exists() and (tmp_path / "a.vocab").exists()
