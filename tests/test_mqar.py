"""Multi-query associative recall: Zoology's construction checked row by row, the power law of the query
slots against its formula, bad options, and the config's run through the causal_lm task."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from favor import data, job
from favor.config import loading
from favor import sweeps
from favor.data import mqar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import mqar as mqar_config  # noqa: E402


def test_every_row_is_zoologys_construction():
    src = mqar.Mqar(vocab_size=256, seq_len=64, num_pairs=8, num_train=50, num_eval=20)
    rows = src.read("train", np.arange(50), np.arange(50), None)
    ids, tgt, w = rows["input_ids"], rows["targets"], rows["weights"]
    assert ids.shape == tgt.shape == w.shape == (50, 64) and np.all(rows["attention_mask"] == 1)
    for i in range(50):
        keys, values = ids[i, 0:16:2], ids[i, 1:16:2]
        assert len(set(keys)) == 8 and np.all((keys >= 1) & (keys < 128))
        assert len(set(values)) == 8 and np.all(values >= 128) and np.all(values < 256)
        asked = np.flatnonzero(w[i])
        assert len(asked) == 8 and np.all(asked >= 16) and np.all((asked - 16) % 2 == 0)
        # each key asked once, and its target is the value that followed it in the context
        assert sorted(ids[i, asked]) == sorted(keys)
        answer = dict(zip(keys, values))
        assert all(tgt[i, p] == answer[ids[i, p]] for p in asked)
        assert np.all(tgt[i][w[i] == 0] == 0)
    # the data is a function of (split, row): read again, or in another batch, it is the same
    again = src.read("train", np.arange(50)[::-1], np.arange(50)[::-1], None)
    np.testing.assert_array_equal(again["input_ids"][::-1], ids)
    assert not np.array_equal(src.read("eval", np.arange(20), np.arange(20), None)["input_ids"], ids[:20])


def test_query_slots_follow_the_power_law():
    """One pair: the query's slot s (0-based) has P(s) ∝ (s + 1)^(power_a − 1) (Zoology's formula), each
    frequency within 5 standard errors."""
    src = mqar.Mqar(vocab_size=64, seq_len=20, num_pairs=1, power_a=0.3, random_non_queries=False,
                    num_train=20_000, num_eval=1)
    rows = src.read("train", np.arange(20_000), np.arange(20_000), None)
    slots = (np.argmax(rows["weights"], axis=1) - 2) // 2
    p = np.arange(1, 10) ** (0.3 - 1.0)
    p /= p.sum()
    freq = np.bincount(slots, minlength=9) / 20_000
    se = np.sqrt(p * (1 - p) / 20_000)
    assert np.all(np.abs(freq - p) < 5 * se), (freq, p)
    # without random non-queries, every position outside the context and the query is 0
    assert np.all(np.sort(rows["input_ids"], axis=1)[:, :-3] == 0)


def test_bad_options_name_the_value():
    for bad, match in ((dict(seq_len=63), "seq_len must be even"), (dict(num_pairs=17), "num_pairs must be in"),
                       (dict(vocab_size=32), "vocab_size 32 must exceed seq_len 64"),
                       (dict(power_a=0), "power_a must be positive")):
        with pytest.raises(ValueError, match=match):
            mqar.Mqar(**bad)
    with pytest.raises(ValueError, match="pairs=0"):
        mqar_config.get_config("pairs=0")


def test_runlocal_trains_through_the_causal_lm_task(tmp_path):
    config = mqar_config.get_config("runlocal")
    job.validate(config)
    summary = job.run(config, tmp_path)
    assert summary["step"] == 30 and 0 <= summary["accuracy"] <= 1 and math.isfinite(summary["loss"])
    assert data.get(config.data).num_pairs == 4


def test_sweep_is_recall_against_state_size_and_every_item_is_a_valid_run():
    spec = str(ROOT / "configs/mqar.py")
    runs = sweeps.load(spec)
    # softmax, 3 random-feature kinds × 3 widths, ELU once, FAVOR+ with a band: 12 settings, 3 seeds, seed by seed
    assert len(runs) == 36 and [r.overrides["seed"] for r in runs] == [s for s in range(3) for _ in range(12)]
    for run in runs[:12]:
        config = loading.load(spec)
        for key, value in run.overrides.items():
            loading.apply_flag(config, f"{key}={value}")
        job.validate(config)
    assert runs[11].name == "kind=favor+_num_features=64_window=8_seed=0"
    with pytest.raises(ValueError, match=r"kinds: unknown 'favor\+\+\+'"):
        sweeps.load(spec + ":kinds=favor+++")
    # others: each at the middle width only, after the width-swept kinds; one already swept is not doubled
    more = sweeps.load(spec + ":seeds=1,kinds=favor+/elu,others=hrf/relu/favor+,widths=8/32/128,bands=")
    assert [(r.overrides["model.attention.kind"], r.overrides.get("model.attention.num_features"))
            for r in more] == [("softmax", None), ("favor+", 8), ("favor+", 32), ("favor+", 128), ("elu", None),
                               ("hrf", 32), ("relu", None)]
    assert more[5].overrides["model.attention.qk_norm"] == "l2" and "model.attention.qk_norm" not in more[1].overrides
    with pytest.raises(ValueError, match=r"others: unknown 'trig'"):
        sweeps.load(spec + ":others=trig")
