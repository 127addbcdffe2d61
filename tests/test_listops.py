"""ListOps by LRA's rules (favor.data.listops_trees, favor.data.listops): the generator, the answers, the
TFDS dataset and its source, and the config end to end on the tiny window."""

import random
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from favor import data, job
from favor.data import listops, listops_trees as trees

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import listops as listops_config  # noqa: E402


def _answer(text):
    """The answer of an expression, computed here from the operators' definitions alone (a recursive
    descent over the text, not favor's evaluation of the tree)."""
    toks = text.split()

    def parse(i):
        t = toks[i]
        if t.isdigit():
            return int(t), i + 1
        args, i = [], i + 1
        while toks[i] != "]":
            v, i = parse(i)
            args.append(v)
        if t == "[MAX":
            v = max(args)
        elif t == "[MIN":
            v = min(args)
        elif t == "[MED":
            s = sorted(args)
            mid = len(s) // 2
            v = s[mid] if len(s) % 2 else int((s[mid - 1] + s[mid]) / 2)
        else:
            assert t == "[SM", t
            v = sum(args) % 10
        return v, i + 1
    v, end = parse(0)
    assert end == len(toks)
    return v


def test_answers_and_lengths_follow_the_rules():
    window = trees.Window(20, 200, 300, 0, 0, max_depth=6, max_args=5)
    pairs = trees.examples(window, seed=3)
    assert len({t for t, _ in pairs}) == len(pairs) == 300                     # distinct
    for text, answer in pairs:
        toks = text.split()
        assert 20 < len(toks) < 200 and answer == _answer(text)
        assert set(toks) <= set(trees.VOCAB[2:])
        # every operator closes, and takes 2…max_args arguments (counted on the text)
        depth, args = 0, []
        for t in toks:
            if t in trees.OPERATORS:
                if args:
                    args[-1] += 1
                args.append(0)
                depth += 1
                assert depth < 6 + 1
            elif t == "]":
                n = args.pop()
                assert 2 <= n <= 5
                depth -= 1
            elif args:
                args[-1] += 1
        assert depth == 0 and not args


def test_the_operator_probability_is_a_quarter_and_arguments_are_uniform():
    """Below the maximum depth a node is an operator with probability 1/4 (LRA's VALUE_P); an operator has
    2…max_args arguments, uniformly: checked on many draws at 5 standard errors."""
    rng = random.Random(0)
    roots = [trees.generate(rng, 1, 10, 10) for _ in range(20000)]
    p = np.mean([not isinstance(t, int) for t in roots])
    assert abs(p - 0.25) < 5 * np.sqrt(0.25 * 0.75 / len(roots)), p
    counts = [len(t[1]) for t in roots if not isinstance(t, int)]
    assert set(counts) == set(range(2, 11)) and abs(statistics.mean(counts) - 6.0) < 5 * np.std(counts) / np.sqrt(len(counts))
    assert all(isinstance(trees.generate(rng, 10, 10, 10), int) for _ in range(100))     # at max_depth: a digit


def test_median_of_an_even_count_is_truncated_as_the_generator_does():
    assert trees.value(("[MED", [1, 2])) == 1 and trees.value(("[MED", [3, 8, 1, 9])) == 5
    assert trees.value(("[SM", [9, 9, ("[MAX", [4, 7])])) == 5
    assert _answer("[MED 3 8 1 9 ]") == 5        # the test's own reading agrees


def test_the_dataset_builds_and_the_source_reads_padded_rows(tmp_path):
    source = data.get({"name": "listops", "window": "tiny", "data_dir": str(tmp_path)})
    assert source.num_examples("train") == 96 and source.num_examples("eval") == 32
    batch = next(source.train_batches(8, 0, 0))
    ids = batch["input_ids"]
    assert ids.shape == (8, trees.WINDOWS["tiny"].max_length) and np.all(ids[:, 0] == trees.CLS)
    np.testing.assert_array_equal(batch["attention_mask"], ids != trees.PAD)
    for row, label in zip(ids, batch["label"]):
        text = " ".join(trees.VOCAB[i] for i in row[1:] if i != trees.PAD)
        assert _answer(text) == label
    with pytest.raises(ValueError, match="unknown window '999'; valid: lra, 1024, 512, 256, shallow, tiny"):
        data.get({"name": "listops", "window": "999", "data_dir": str(tmp_path)})


def test_runlocal_trains_softmax_and_the_bag_baseline(tmp_path, monkeypatch):
    monkeypatch.setenv("FAVOR_DATA_DIR", str(tmp_path / "data"))
    for name, arg in (("softmax", "runlocal"), ("bag", "runlocal,bag"), ("favor+", "runlocal,kind=favor+")):
        summary = job.run(listops_config.get_config(arg), tmp_path / name)
        assert summary["step"] == 12 and np.isfinite(summary["train_loss"]) and 0 <= summary["accuracy"] <= 1
    assert job.model_builder(listops_config.get_config("runlocal,bag"))[1]["num_layers"] == 0
