"""favor_docstring_order: the local sentence-order task (favor.data.docorder) built from the standard
library, checked against the docstrings it reads."""

import collections
import re

import numpy as np
import tensorflow_datasets as tfds

from favor.data import docorder, docstrings, glue, local

DOC = """Summary line that is long enough.

First sentence of the body is here. Second one follows it! Third, a question? yes, lower case keeps
it whole. Fourth sentence wraps over a line.

    This indented block has words. It would make a pair if kept.

>>> print("a doctest line") shows output. Another sentence follows here.

Use a helper, e.g. The one named here. It ends now.

Another paragraph starts. It has two sentences here.

Too short. Ok then, three words.

:param x: a field list entry here. Dropped too with it.

Args:
    x: the first argument of this. Second sentence of it here.

- A bullet item is here. It has a second sentence.

.. versionadded:: 3.2 A directive is here. It has words too.
"""


def test_pairs_are_consecutive_sentences_of_one_prose_paragraph():
    got = [(a, b) for _, a, b in docorder.pairs(DOC)]
    assert got == [("First sentence of the body is here.", "Second one follows it!"),
                   ("Second one follows it!", "Third, a question? yes, lower case keeps it whole."),
                   ("Third, a question? yes, lower case keeps it whole.", "Fourth sentence wraps over a line."),
                   ("Use a helper, e.g. The one named here.", "It ends now."),
                   ("Another paragraph starts.", "It has two sentences here.")]
    # each dropped paragraph holds two sentences of 3+ words: without its marker it makes a pair, so only
    # the filters keep it out
    dropped = {"    This indented block has words. It would make a pair if kept.": "    ",
               '>>> print("a doctest line") shows output. Another sentence follows here.': ">>> ",
               ":param x: a field list entry here. Dropped too with it.": ":param x: ",
               "Args:\n    x: the first argument of this. Second sentence of it here.": "Args:\n    x: ",
               "- A bullet item is here. It has a second sentence.": "- ",
               ".. versionadded:: 3.2 A directive is here. It has words too.": ".. versionadded:: 3.2 "}
    for para, marker in dropped.items():
        assert para in DOC and list(docorder.pairs(para)) == [], para
        assert len(list(docorder.pairs(para.replace(marker, "")))) == 1, para


def test_built_dataset_holds_each_pair_in_both_orders_from_its_modules_split(tmp_path):
    local.prepare("docorder", tmp_path)
    builder = tfds.builder("favor_docstring_order", data_dir=str(tmp_path))
    text_of = {}                        # docstring name -> its split, its paragraphs' normalised text
    for module, path in docstrings.stdlib_files():
        for name, doc in docstrings.docstrings(module, path):
            paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc)]
            text_of[name] = (docstrings.split_of(module), paras)
    train_pairs = set()
    for split in ("train", "validation"):
        src = builder.as_data_source(split=split)
        rows = [src[i] for i in range(len(src))]
        assert len(rows) > (200 if split == "validation" else 4000), (split, len(rows))
        labels = np.array([r["label"] for r in rows])
        assert labels.sum() * 2 == len(rows)                       # exactly balanced
        by_pair = collections.defaultdict(dict)
        for r in rows:
            key = r["idx"].decode().rstrip("~")
            by_pair[key][int(r["label"])] = (r["sentence1"].decode(), r["sentence2"].decode())
        for key, both in by_pair.items():
            assert set(both) == {0, 1} and both[0] == both[1][::-1], key
            name = re.sub(r"#\d+$", "", key)
            where, paras = text_of[name]
            assert where == split, (key, where, split)             # the docstrings corpus's split by module
            first, second = both[1]
            assert any(f"{first} {second}" in p for p in paras), key   # consecutive in one paragraph, in order
            if split == "train":
                train_pairs.add(both[1])
            else:
                assert both[1] not in train_pairs, key             # no validation pair was seen in training

    # the GLUE pipeline reads the prepared corpus (random access) as it reads glue/<task>
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz"]))
    source = glue.Glue("docorder", tokenizer=f"wordpiece:{vocab}", max_length=32, buckets=(32,), data_dir=tmp_path)
    assert source.num_eval == len(rows) and source.num_labels == 2
    assert source.eval["label"].sum() * 2 == len(rows)
    assert (source.eval["token_type_ids"].max(1) == 1).all()                # two segments in every row
