"""GLUE fine-tuning end to end on TFDS mock data; warm start from a Hugging Face BERT."""

import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from favor import job

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import bert_glue  # noqa: E402

LETTERS = "abcdefghij"


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *LETTERS, *(f"##{c}" for c in LETTERS)]
    path.write_text("\n".join(words + [f"[unused{i}]" for i in range(32 - len(words))]) + "\n")
    return path


@pytest.mark.parametrize("task", ["cola", "stsb", "mnli"])
def test_glue_runlocal_trains_and_reports_the_task_metrics(task, vocab, tmp_path):
    config = bert_glue.get_config(f"task={task},vocab={vocab},runlocal")
    with tfds.testing.mock_data(num_examples=40, policy=tfds.testing.MockPolicy.USE_CODE):
        summary = job.run(config, tmp_path)
    expected = {"cola": {"matthews_corrcoef"}, "stsb": {"pearson", "spearman"}, "mnli": {"accuracy"}}[task]
    assert expected <= set(summary) and summary["step"] == 12
    assert all(np.isfinite(summary[m]) for m in expected) and np.isfinite(summary["train_loss"])


def test_warm_start_from_hugging_face_bert(vocab, tmp_path, hf_reference):
    ref = np.load(hf_reference / "glue" / "reference.npz")       # a BERT with a sequence classifier
    config = bert_glue.get_config(f"task=sst2,vocab={vocab},runlocal")
    config.model.init_from = f"hf:{hf_reference / 'glue'}"
    config.total_steps = 0                     # no step: the final params are the checkpoint's
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
        summary = job.run(config, tmp_path / "run")
    params = summary.state["params"]
    w = np.asarray(params["layers"][0]["attention"]["query"]["kernel"][...])
    np.testing.assert_allclose(w, ref["layer0_query_weight"].T, atol=1e-6)
    config.model.init_from = "bert-base-uncased"
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
        with pytest.raises(ValueError, match="must be '' .fresh weights. or name a source: expected 'run:<workdir>'"):
            job.run(config, tmp_path / "bad")
