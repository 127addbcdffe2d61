"""`python -m favor.tools.inspect`: per layer and head, each kind's attention error against softmax on a
trained run's own evaluation inputs."""

import json

import numpy as np
import pytest

from favor import job
from favor.tools import inspect as favor_inspect
from test_train import tiny


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("inspect") / "run"
    job.run(tiny(total_steps=30, checkpoint_every=30, eval_every=30, log_every=30), workdir)
    return workdir


def test_softmax_is_exact_and_favor_plus_error_falls_with_features(run):
    result = favor_inspect.inspect(run, kinds=("softmax", "favor+"), num_features=(2, 64, 2048), batches=2,
                                   log=print)
    kinds = result["kinds"]
    assert set(kinds) == {"softmax", "favor+ (F=2)", "favor+ (F=64)", "favor+ (F=2048)"}
    assert result["own_draw"] == []              # a run that redraws: every kind gets inspect's own draw
    shape = (result["layers"], result["heads"])
    assert np.asarray(kinds["softmax"]["relative_error"]).shape == shape
    np.testing.assert_array_equal(kinds["softmax"]["relative_error"], 0.0)
    few, mid, many = (np.asarray(kinds[f"favor+ (F={m})"]["relative_error"]) for m in (2, 64, 2048))
    assert np.all(few > 0) and np.all(np.isfinite(many))
    # this run's keys are large (relative variances in the thousands): the error falls slower than
    # 1/√M, but it falls (measured: 0.26, 0.15, 0.10 at M = 2, 64, 4096)
    assert few.mean() > mid.mean() > many.mean() and many.mean() < 0.6 * few.mean(), (few, mid, many)
    # the analytic relative variance falls as 1/M for iid features (same inputs)
    v2, v64 = (np.asarray(kinds[f"favor+ (F={m})"]["relative_variance"]) for m in (2, 64))
    np.testing.assert_allclose(v2 / v64, 32.0, rtol=1e-4)
    # norms of the scaled queries/keys: positive, the max at least the mean
    assert np.all(np.asarray(result["query_norm"]) > 0)
    assert np.all(np.asarray(result["key_norm_max"]) >= np.asarray(result["key_norm"]))


def test_command_prints_plots_and_writes_json(run, tmp_path, capsys):
    png, js = tmp_path / "inspect.png", tmp_path / "inspect.json"
    code = favor_inspect.main(["--workdir", str(run), "--kinds", "softmax,favor#,favor+@2", "--num_features", "8",
                               "--batches", "1", "--plot", str(png), "--json", str(js)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "favor# (F=8): relative error of the attention output against softmax" in out
    assert "favor+@2 (F=8)" in out and "layer 0" in out and "head 0" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(js.read_text())
    assert data["kinds"]["favor+@2 (F=8)"]["relative_variance"] is None        # no formula with a window
    assert data["kinds"]["favor# (F=8)"]["relative_variance"] is not None


@pytest.mark.parametrize("argv,message", [
    (["--kinds", "favor++,nope"], "unknown attention kind 'nope'"),
    (["--kinds", "favor+:saderf"], "'favor+' has no variant"),
    (["--kinds", "favor+@x"], "the part after '@' is a window, a whole number of tokens"),
    (["--num_features", "0"], "--num_features '0': expected positive integers"),
])
def test_bad_arguments_are_one_clear_error(run, argv, message, capsys):
    assert favor_inspect.main(["--workdir", str(run), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_directory_without_checkpoints_is_a_clear_error(tmp_path, capsys):
    assert favor_inspect.main(["--workdir", str(tmp_path)]) == 2
    assert "no checkpoints/ there" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["favor", "hrf"])
def test_sign_indefinite_kinds_train_with_few_nonpositive_denominators(kind, tmp_path):
    """A trig / HRF model trained on the runlocal config with queries and keys on a learned sphere
    (qk_norm="l2"): on its own evaluation inputs few rows' estimated denominators are ≤ 0 (at most a
    fifth in any head, where models without the sphere have a third to two thirds: README, inspect);
    inspect reports that fraction and the fraction below the floor, each in [0, 1], for sign-indefinite
    kinds only. Not zero: an unbiased sign-indefinite estimate can fall to ≤ 0 on a trained model's rows,
    and how many depends on the draws (HRF: 0 to 9 % of a head's rows over seeds 0–9)."""
    # the sphere starts with nearly uniform attention (logits in [−1, 1]): 192 steps, not the config's 64
    config = tiny(**{"model.attention.kind": kind, "model.attention.qk_norm": "l2", "total_steps": 192,
                     "model.attention.num_features": 128,
                     "eval_every": 96, "checkpoint_every": 96})
    summary = job.run(config, tmp_path / "run")
    assert summary["accuracy"] > 0.3, summary                       # chance is 0.1
    result = favor_inspect.inspect(tmp_path / "run", kinds=(kind, "favor+"), num_features=(None,), batches=2,
                                   log=print)
    label = next(k for k in result["kinds"] if k.startswith(kind + " "))
    nonpositive = np.asarray(result["kinds"][label]["nonpositive_fraction"])
    below = np.asarray(result["kinds"][label]["below_floor_fraction"])
    assert nonpositive.shape == (result["layers"], result["heads"])
    assert np.all((nonpositive >= 0) & (nonpositive <= 0.2)), nonpositive
    assert np.all((below >= 0) & (below <= 1))
    assert "nonpositive_fraction" not in next(v for k, v in result["kinds"].items() if k.startswith("favor+"))


def test_a_fixed_draw_run_is_inspected_on_its_stored_draw(tmp_path):
    """On a run that keeps one ω (redraw="fixed") the run's own kind is inspected with the ω its layers
    store, the one it trained and evaluates with: its figures do not depend on inspect's --seed, while
    another kind's (a fresh draw) do."""
    config = tiny(**{"model.attention.kind": "favor", "model.attention.redraw": "fixed", "total_steps": 16,
                     "eval_every": 16, "checkpoint_every": 16})
    job.run(config, tmp_path / "run")
    a, b = (favor_inspect.inspect(tmp_path / "run", kinds=("favor", "favor+"), batches=1, seed=s, log=print)
            for s in (0, 1))
    assert a["own_draw"] == ["favor (F=16)"]
    np.testing.assert_array_equal(a["kinds"]["favor (F=16)"]["relative_error"],
                                  b["kinds"]["favor (F=16)"]["relative_error"])
    assert not np.array_equal(a["kinds"]["favor+ (F=16)"]["relative_error"],
                              b["kinds"]["favor+ (F=16)"]["relative_error"])
