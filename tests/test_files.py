"""Your own text (favor.data.files): plain-text paragraphs and JSONL lines as documents, TFDS-style
slices of them, packed by the causal pipeline exactly as a stream of each document's ids and an
end-of-text token, re-tokenized when a file changes, and a decoder trained on them end to end."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers

from favor import job, uptrain
from favor.config import loading
from favor.data import files, text, tokenizers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import decoder_lm  # noqa: E402

WORDS = "the model reads every token of the text and predicts the next one from what came before it".split()


def corpus(root: Path, n_json=40, n_txt=10) -> list[str]:
    """b.jsonl's documents then notes/a.txt's paragraphs (the sorted order of their paths), as written."""
    rng = np.random.default_rng(0)
    doc = lambda k: " ".join(rng.choice(WORDS, k))
    json_docs = [doc(int(rng.integers(5, 30))) for _ in range(n_json)]
    txt_docs = [doc(12) + "\n" + doc(6) for _ in range(n_txt)]       # a paragraph spans lines
    root.mkdir(parents=True, exist_ok=True)
    (root / "b.jsonl").write_text("\n".join(json.dumps({"id": i, "text": d}) for i, d in enumerate(json_docs))
                                  + "\n\n")
    (root / "notes").mkdir(exist_ok=True)
    (root / "notes" / "a.txt").write_text("\n\n\n".join(txt_docs) + "\n")
    return json_docs + txt_docs


def test_documents_are_jsonl_lines_and_text_paragraphs_in_path_order(tmp_path):
    docs = corpus(tmp_path / "c")
    got = files.documents(files.paths(f"files:{tmp_path / 'c'}"), "text")
    assert got == docs
    # a glob and a single file name the same files
    assert files.documents(files.paths(f"files:{tmp_path / 'c' / '**' / '*.txt'}"), "text") == docs[40:]
    assert files.documents(files.paths(f"files:{tmp_path / 'c' / 'b.jsonl'}"), "text") == docs[:40]


def test_splits_slice_the_documents_as_tfds_slices_a_split():
    n = 50
    docs = list(range(n))
    for split, want in (("train", docs), ("train[:98%]", docs[:49]), ("train[98%:]", docs[49:]),
                        ("train[10%:20%]", docs[5:10]), ("train[3:7]", docs[3:7]), ("train[-2:]", docs[-2:])):
        assert docs[files.split_slice(split, n)] == want, split
    with pytest.raises(loading.ConfigError, match=r"config.data.eval_split='validation': files: has one split"):
        files.split_slice("validation", n, "data.eval_split")


def test_bad_files_are_one_clear_error(tmp_path):
    with pytest.raises(loading.ConfigError, match=r"config.data.dataset='files:.*nothing\*': matches no "):
        files.paths(f"files:{tmp_path / 'nothing*'}")
    (tmp_path / "x.jsonl").write_text('{"body": "a"}\n')
    with pytest.raises(loading.ConfigError, match=r"config.data.text_field='text': .*x.jsonl line 1 has no text "
                                                    r"under it \('body'\)"):
        files.documents(files.paths(f"files:{tmp_path / 'x.jsonl'}"), "text")
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(loading.ConfigError, match="line 2 is not JSON"):
        files.documents(files.paths(f"files:{tmp_path / 'x.jsonl'}"), "text")
    (tmp_path / "y.csv").write_text("a,b\n")
    with pytest.raises(loading.ConfigError, match=r"y.csv is neither plain text nor JSONL; files: takes .txt"):
        files.paths(f"files:{tmp_path / '*'}")
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(loading.ConfigError, match=r"config.data.eval_split='train\[99%:\]': holds none of the 1 "):
        files.open_splits(f"files:{tmp_path / 'x.jsonl'}", "text", {"data.train_split": "train",
                                                                      "data.eval_split": "train[99%:]"})


def word_tokenizer(directory: Path) -> str:
    words = Tokenizer(tok_models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    directory.mkdir(parents=True, exist_ok=True)
    words.save(str(directory / "tokenizer.json"))
    return f"hf:{directory}"


def test_causal_rows_are_the_documents_ids_each_ended_by_end_of_text(tmp_path):
    docs = corpus(tmp_path / "c")
    spec = word_tokenizer(tmp_path / "tok")
    src = text.CausalText(dataset=f"files:{tmp_path / 'c'}", train_split="train[:80%]", eval_split="train[80%:]",
                          data_dir=str(tmp_path / "cache"), tokenizer=spec, max_length=16, max_eval_rows=0)
    words = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))      # the reference, apart from favor
    eos = words.token_to_id("</s>")
    stream = lambda ds: [i for d in ds for i in [*words.encode(d, add_special_tokens=False).ids, eos]]
    assert list(src.tokens["train"]) == stream(docs[:40]) and list(src.tokens["eval"]) == stream(docs[40:])
    batch = src.read("train", np.arange(3), np.arange(3), None)
    want = np.asarray(stream(docs[:40])[:3 * 16 + 1])
    for row in range(3):
        np.testing.assert_array_equal(batch["input_ids"][row], want[row * 16:(row + 1) * 16])
        np.testing.assert_array_equal(batch["targets"][row], want[row * 16 + 1:(row + 1) * 16 + 1])
    # an edited file is another corpus: tokenized again, never read from the stale cache
    before = files.cache_name(f"files:{tmp_path / 'c'}")
    (tmp_path / "c" / "notes" / "a.txt").write_text("the model reads\n")
    os.utime(tmp_path / "c" / "notes" / "a.txt", ns=(1, 1))
    assert files.cache_name(f"files:{tmp_path / 'c'}") != before
    again = text.CausalText(dataset=f"files:{tmp_path / 'c'}", train_split="train", eval_split="train[-1:]",
                            data_dir=str(tmp_path / "cache"), tokenizer=spec, max_length=16)
    assert list(again.tokens["train"]) == stream(docs[:40] + ["the model reads"])


def test_a_decoder_trains_on_your_own_text_with_its_own_tokenizer(tmp_path, monkeypatch):
    corpus(tmp_path / "c", n_json=200, n_txt=20)
    monkeypatch.setenv("FAVOR_DATA_DIR", str(tmp_path / "cache"))
    config = decoder_lm.get_config(f"runlocal,text={tmp_path / 'c'}")
    assert config.data.dataset == f"files:{tmp_path / 'c'}"
    config.total_steps, config.eval_every, config.checkpoint_every = 6, 6, 6
    summary = job.run(config, tmp_path / "run")
    assert summary["step"] == 6 and np.isfinite(summary["perplexity"])
    # the sentencepiece model trained on the files travels with the run, and encodes them
    recorded = tokenizers.get(uptrain.recorded_tokenizer(tmp_path / "run"))
    ids = recorded.ids(["the model reads every token"])[0]
    assert recorded.decode(ids) == "the model reads every token"
