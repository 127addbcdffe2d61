"""A source mixed into training batches (data.mix_in / data.mix_rate): the share and positions of every
batch, each source's own epoch order (nothing repeated or skipped), resume, hosts' slices, evaluation on the
main source alone, and the errors."""

import numpy as np
import pytest

from favor import data, job
from favor.config import loading
from favor.data import mixture, mqar
from favor.data.source import ArraySource


class Rows(ArraySource):
    """Rows that say which source and which row they are: id = offset + row."""

    def __init__(self, n, offset, width=3, n_eval=5):
        self.train = {"x": (offset + np.arange(n))[:, None].repeat(width, 1), "w": np.ones((n, width), np.float32)}
        self.eval = {"x": (offset + 10_000 + np.arange(n_eval))[:, None].repeat(width, 1),
                     "w": np.ones((n_eval, width), np.float32)}


def _ids(batch):
    return batch["x"][:, 0]


def test_positions_are_the_share_evenly_spread():
    for b in (1, 4, 7, 16, 64):
        for rate in (0.1, 0.25, 0.5, 0.9):
            p = mixture.mixed_positions(b, rate)
            assert len(p) == round(rate * b) and len(set(p)) == len(p)
            assert np.all((p >= 0) & (p < b)) and np.all(np.diff(p) > 0)
            if len(p) > 1:      # evenly spread: gaps differ by at most one row
                gaps = np.diff(np.r_[p, p[0] + b])
                assert gaps.max() - gaps.min() <= 1


def test_every_batch_mixes_the_share_and_each_source_keeps_its_order():
    main, extra = Rows(23, 0), Rows(7, 1000)
    mix = mixture.Mixture(main, extra, 0.25)
    batches = mix.train_batches(8, 0, seed=3)
    seen_main, seen_extra = [], []
    for _ in range(6):
        ids = _ids(next(batches))
        from_extra = ids >= 1000
        np.testing.assert_array_equal(np.flatnonzero(from_extra), [0, 4])      # 2 of 8 rows, spread
        seen_main += list(ids[~from_extra])
        seen_extra += list(ids[from_extra] - 1000)
    # 36 main rows: the first epoch's 23 once each, then 13 of the next; 12 mixed rows over 7: the same
    assert sorted(seen_main[:23]) == list(range(23)) and len(set(seen_main[23:])) == 13
    assert sorted(seen_extra[:7]) == list(range(7)) and len(set(seen_extra[7:])) == 5


def test_resume_continues_both_sources_exactly():
    mix = mixture.Mixture(Rows(23, 0), Rows(7, 1000), 0.3)
    first = [_ids(b) for _, b in zip(range(9), mix.train_batches(10, 0, seed=1))]
    resumed = [_ids(b) for _, b in zip(range(4), mix.train_batches(10, 5, seed=1))]
    for a, b in zip(first[5:], resumed):
        np.testing.assert_array_equal(a, b)


def test_hosts_slices_make_the_global_batch(monkeypatch):
    mix = mixture.Mixture(Rows(40, 0), Rows(9, 1000), 0.25)
    whole = [_ids(b) for _, b in zip(range(5), mix.train_batches(8, 2, seed=4))]
    import jax
    parts = []
    for host in range(2):
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(jax, "process_index", lambda host=host: host)
        parts.append([_ids(b) for _, b in zip(range(5), mix.train_batches(8, 2, seed=4))])
    for step in range(5):
        np.testing.assert_array_equal(np.concatenate([parts[0][step], parts[1][step]]), whole[step])


def test_evaluation_reads_the_main_source_alone():
    mix = mixture.Mixture(Rows(23, 0), Rows(7, 1000), 0.5)
    assert mix.num_eval == 5
    ids = np.concatenate([_ids(b)[b["valid"]] for b in mix.eval_batches(4)])
    np.testing.assert_array_equal(ids, 10_000 + np.arange(5))


def test_a_mismatched_source_is_an_error_naming_both():
    """Checked when the mixture is built, so every host refuses it alike (whichever rows its slice holds)."""
    with pytest.raises(ValueError, match=r"mix_in.*wide.*\(4,\).*rows.*\(3,\)"):
        mixture.Mixture(Rows(23, 0, width=3), Rows(7, 1000, width=4), 0.5, names=("rows", "wide"))
    floats = Rows(7, 1000)
    floats.train["x"] = floats.train["x"].astype(np.float64) + 0.7
    with pytest.raises(ValueError, match=r"mix_in.*float64.*int64"):       # no silent cast of 1000.7 to 1000
        mixture.Mixture(Rows(23, 0), floats, 0.5)
    wide = Rows(7, 1000)
    wide.host_dependent_shapes = True
    with pytest.raises(ValueError, match=r"widths depend on the rows read"):
        mixture.Mixture(Rows(23, 0), wide, 0.5)
    with pytest.raises(ValueError, match="mix_rate=0.99: fills all 4 rows"):
        next(mixture.Mixture(Rows(5, 0), Rows(5, 1000), 0.99).train_batches(4))
    with pytest.raises(ValueError, match=r"mix_rate=0.05: mixes no row into a batch of 8 .*at least 0.0625"):
        next(mixture.Mixture(Rows(5, 0), Rows(5, 1000), 0.05).train_batches(8))


def test_a_config_block_builds_the_mixture():
    block = {"name": "mqar", "vocab_size": 300, "seq_len": 32, "num_pairs": 4, "num_train": 50, "num_eval": 10,
             "mix_in": {"name": "mqar", "vocab_size": 64, "seq_len": 32, "num_pairs": 2, "num_train": 20},
             "mix_rate": 0.5}
    data.check(block)
    src = data.get(block)
    assert isinstance(src, mixture.Mixture) and src.vocab_size == 300 and src.num_eval == 10
    batch = next(src.train_batches(6))
    small = np.zeros(6, bool)
    small[mixture.mixed_positions(6, 0.5)] = True
    # the mixed-in rows are the small-vocabulary task's (2 pairs: 2 weighted queries), the others the main one's
    assert batch["input_ids"][small].max() < 64 and np.all(batch["weights"][small].sum(1) == 2)
    assert np.all(batch["weights"][~small].sum(1) == 4)
    # an empty mix_in is nothing mixed in (a config's placeholder)
    assert isinstance(data.get({**block, "mix_in": {}, "mix_rate": 0.0}), mqar.Mqar)


@pytest.mark.parametrize("mix, match", [
    ({"mix_rate": 0.3}, r"mix_rate=0.3: needs data.mix_in"),
    ({"mix_in": "mqar", "mix_rate": 0.3}, r"mix_in='mqar': expected a data block"),
    ({"mix_in": {"name": "mqar"}, "mix_rate": 1.5}, r"mix_rate=1.5: .* in \(0, 1\)"),
    ({"mix_in": {"name": "mqar"}}, r"mix_rate=missing"),
    ({"mix_in": {"name": "mqar"}, "mix_rate": "abc"}, r"mix_rate='abc'"),
    ({"mix_in": {"name": "nope"}, "mix_rate": 0.5}, r"nope"),
    ({"mix_in": {"name": "mqar", "colour": 1}, "mix_rate": 0.5}, r"^data.mix_in: .*colour"),
    ({"mix_in": {"name": "mqar", "mix_in": {"name": "mqar"}}, "mix_rate": 0.5}, r"cannot mix in another"),
])
def test_bad_mix_keys_are_errors(mix, match):
    with pytest.raises((ValueError, KeyError), match=match):
        data.check({"name": "mqar", **mix})


def test_the_config_check_reports_a_bad_mix_in_one_line():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from configs import mqar as mqar_config
    c = mqar_config.get_config("runlocal")
    c.data.mix_rate = 0.5
    with pytest.raises(loading.ConfigError, match=r"config.data=.*mix_rate=0.5: needs data.mix_in"):
        job.validate(c)
