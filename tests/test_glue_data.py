"""GLUE: TFDS builders under mock data, WordPiece tokenization as Hugging Face BERT, GLUE metrics."""

import numpy as np
import pytest
import tensorflow_datasets as tfds
from scipy import stats
from sklearn import metrics as skm

from favor import data
from favor.tasks import metrics
from favor.data import glue, tokenizers

LETTERS = "abcdefghij"


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *LETTERS, *(f"##{c}" for c in LETTERS), "ab", "##cd"]
    path.write_text("\n".join(words) + "\n")
    return path


def test_wordpiece_matches_hugging_face_bert_tokenizer(vocab_file):
    from transformers import BertTokenizer
    ref = BertTokenizer.from_pretrained(str(vocab_file.parent))     # how a BERT checkpoint's vocab loads
    tok = tokenizers.get(f"wordpiece:{vocab_file}")
    first = ["Abcd efg hij", "a", "jjjjjjjjjjjj bbbbbbbbbbb"]
    second = ["ba dc", "abcdefghij abcdefghij abcdefghij", "c"]
    ids, types, mask = tok.encode(first, second, 16)
    for i in range(3):
        r = ref(first[i], second[i], truncation="longest_first", max_length=16, padding="max_length")
        assert ids[i].tolist() == r["input_ids"], i
        assert types[i].tolist() == r["token_type_ids"] and mask[i].tolist() == r["attention_mask"]
    single, _, _ = tok.encode(first, None, 8)
    assert single[0].tolist() == ref(first[0], truncation=True, max_length=8, padding="max_length")["input_ids"]


def test_bad_tokenizer_specs(vocab_file, tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer 'bpe:x'"):
        tokenizers.get("bpe:x")
    with pytest.raises(FileNotFoundError, match="vocab.txt"):
        tokenizers.get(f"wordpiece:{tmp_path / 'vocab.txt'}")


@pytest.mark.parametrize("task", sorted(glue.FIELDS))
def test_every_glue_task_through_the_tfds_builder(task, vocab_file, tmp_path, monkeypatch):
    # favor's local tasks are "built" (mocked here) into FAVOR_DATA_DIR: a directory of the test's own, so
    # the test neither touches the user's cache nor depends on another test having created it
    monkeypatch.setenv("FAVOR_DATA_DIR", str(tmp_path / "favor_data"))
    with tfds.testing.mock_data(num_examples=21, policy=tfds.testing.MockPolicy.USE_CODE):
        source = data.get({"name": "glue", "task": task, "tokenizer": f"wordpiece:{vocab_file}", "max_length": 48,
                           "buckets": (16, 32)})
    assert source.num_train == 21 and source.num_eval == 21
    batch = next(source.train_batches(8, 0, seed=1))
    width = batch["input_ids"].shape[1]
    assert width in (16, 32, 48) and batch["attention_mask"].sum(1).max() <= width
    if width > 16:    # the bucket is the smallest that holds the longest row
        assert batch["attention_mask"].sum(1).max() > {32: 16, 48: 32}[width]
    assert np.all(batch["input_ids"][:, 0] == 2)                               # [CLS]
    two = glue.FIELDS[task][1] is not None
    assert (batch["token_type_ids"].max() == 1) == two
    assert batch["label"].dtype == (np.float32 if task == "stsb" else np.int32)
    assert source.num_labels == {"mnli": 3, "stsb": 1}.get(task, 2)
    # resumable: batch 3 of a stream started at 0 equals batch 0 of a stream started at 3
    stream = source.train_batches(8, 0, seed=1)
    third = [next(stream) for _ in range(4)][3]
    again = next(source.train_batches(8, 3, seed=1))
    for k in third:
        np.testing.assert_array_equal(third[k], again[k])
    # eval covers the split once, padding rows marked invalid
    ev = list(source.eval_batches(8))
    assert sum(int(b["valid"].sum()) for b in ev) == 21 and len(ev) == 3


def test_an_epoch_sees_every_example_once(vocab_file):
    with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
        source = data.get({"name": "glue", "task": "sst2", "tokenizer": f"wordpiece:{vocab_file}", "max_length": 32})
    rows = np.concatenate([source.train_indices(8, s, seed=3) for s in range(3)])
    assert sorted(rows.tolist()) == list(range(24))


def test_missing_dataset_says_how_to_prepare_it(vocab_file, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"glue/rte .*not prepared.*tfds build glue/rte"):
        data.get({"name": "glue", "task": "rte", "tokenizer": f"wordpiece:{vocab_file}", "data_dir": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=r"data_dir .*no_data does not exist .*tfds build glue/rte"):
        data.get({"name": "glue", "task": "rte", "tokenizer": f"wordpiece:{vocab_file}",
                  "data_dir": str(tmp_path / "no_data")})
    with pytest.raises(ValueError, match="unknown GLUE task 'sst'"):
        data.get({"name": "glue", "task": "sst", "tokenizer": f"wordpiece:{vocab_file}"})


def test_glue_metrics_against_scipy_and_sklearn():
    rng = np.random.RandomState(0)
    label = rng.randint(0, 2, 50)
    pred = np.where(rng.rand(50) < 0.8, label, 1 - label)
    valid = np.ones(50, bool)
    valid[45:] = False
    pred_padded = pred.copy()
    pred_padded[45:] = 1 - label[45:]          # padding rows are wrong on purpose: must not count
    got = metrics.glue("mrpc", pred_padded, label, valid)
    assert got["f1"] == pytest.approx(skm.f1_score(label[:45], pred[:45]))
    assert got["accuracy"] == pytest.approx(np.mean(label[:45] == pred[:45]))
    # Matthews by its formula
    p, t = pred[:45], label[:45]
    tp, tn = np.sum((p == 1) & (t == 1)), np.sum((p == 0) & (t == 0))
    fp, fn = np.sum((p == 1) & (t == 0)), np.sum((p == 0) & (t == 1))
    mcc = (tp * tn - fp * fn) / np.sqrt(float((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
    assert metrics.glue("cola", pred_padded, label, valid)["matthews_corrcoef"] == pytest.approx(mcc)
    x, y = rng.normal(size=40), rng.normal(size=40)
    y = 0.6 * x + 0.4 * y
    got = metrics.glue("stsb", x, y)
    assert got["pearson"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert got["spearman"] == pytest.approx(stats.pearsonr(stats.rankdata(x), stats.rankdata(y))[0])
    with pytest.raises(ValueError, match="unknown GLUE task 'sts'"):
        metrics.glue("sts", x, y)
