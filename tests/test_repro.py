"""`python -m favor.repro`: every reproduction's --quick run writes its three files, its table has the
paper's columns, its figures are finite and the paper's ordering claims hold on them."""

import json
import math

import pytest

from favor import repro
from favor.repro.__main__ import main

# the columns each table must carry (the paper's quantity beside favor's)
COLUMNS = {
    "crt-variance": ["regime", "comparison at σ = 1", "paper (log gain)", "favor (log gain)", "agrees"],
    "crt-classify": ["data set", "TrigRF", "PosRF", "OPRF", "PoisRF+", "exact kernel"],
    "simrf-mse": ["quantity", "paper", "favor"],
    "simrf-classify": ["data set", "d", "IIDRF", "ORF", "SimRF", "SimRF+", "exact kernel"],
    "hrf-pointwise": ["r", "estimator", "quantity", "paper", "favor (analytic)", "favor (empirical)"],
    "favor-sharp-variance": ["regime", "σ", "GERF (favor: oprf) log(Var/K²)", "SDERF log(Var/K²)"],
    "importance-sampling": ["regime", "σ", "PosRF", "PosRF + IS", "V* (Cor. 2) / Cor. 1 bound"],
}


def _numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x
    elif isinstance(x, str) and x in ("nan", "inf", "-inf"):
        yield float(x)


def test_every_registered_reproduction_is_tested():
    assert set(repro.names()) == set(COLUMNS)


@pytest.mark.parametrize("name", sorted(COLUMNS))
def test_quick_run_writes_a_checked_report(name, tmp_path, capsys):
    out = tmp_path / name
    assert main([name, "--quick", "--out", str(out)]) == 0
    files = {p.name for p in out.iterdir()}
    assert files == {f"{name}.png", f"{name}.md", f"{name}.json"}, files   # no temporary left over
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / f"{name}.json").read_text())
    for col in COLUMNS[name]:
        assert col in data["columns"], (col, data["columns"])
    nums = list(_numbers(data["figures"])) + list(_numbers(data["rows"]))
    assert nums and all(math.isfinite(v) for v in nums), name
    failed = [claim for claim, ok in data["checks"] if not ok]
    assert data["checks"] and not failed, failed
    md = (out / f"{name}.md").read_text()
    assert "| " + " | ".join(data["columns"]) + " |" in md and "--quick" in md


def test_list_names_every_reproduction(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in repro.names())


def test_unknown_reproduction_is_a_clear_error(capsys):
    assert main(["crt-varience"]) == 2
    err = capsys.readouterr().err
    assert "crt-varience" in err and "crt-variance" in err


def test_interrupted_write_leaves_no_report(tmp_path, monkeypatch):
    """A plot that fails mid-write leaves neither a final nor a temporary file."""
    from favor.repro.report import Report, write

    def bad_plot(fig):
        raise RuntimeError("plot failed")

    r = Report(title="t", protocol="p", columns=["a"], rows=[[1.0]], figures={}, plot=bad_plot)
    with pytest.raises(RuntimeError):
        write(r, str(tmp_path), "x")
    assert [p for p in tmp_path.iterdir()] == []


def test_kernel_regression_prediction_matches_float64(capsys):
    """classify._predict (log-space, column- and row-stabilised, signed features) against r* computed
    directly in float64, including a query whose denominator is negative (argmax of r* then picks the
    class with the most negative numerator) and huge log-scales that overflow a plain exp."""
    import numpy as np
    import jax.numpy as jnp
    from favor.repro.classify import _predict

    rng = np.random.default_rng(0)
    q, n, f, c = 6, 20, 8, 3
    lq = rng.normal(size=(q, f)) * 3 + 300.0          # e^300 · e^300 overflows float64 too: shifts
    lk = rng.normal(size=(n, f)) * 3 - 250.0
    sq = rng.choice([-1.0, 1.0], size=(q, f))
    sk = rng.choice([-1.0, 1.0], size=(n, f))
    y = rng.integers(0, c, n)
    onehot = np.eye(c)[y]
    kq = sq * np.exp(lq - 300.0)                       # the common factors e^300, e^-250 cancel in r*
    kk = sk * np.exp(lk + 250.0)
    num = (kq @ kk.T) @ onehot                         # [q, c]
    r = num / num.sum(-1, keepdims=True)
    want = np.argmax(r, -1)
    assert (num.sum(-1) < 0).any() and (num.sum(-1) > 0).any()
    got = np.asarray(_predict(jnp.asarray(lq, jnp.float32), jnp.asarray(sq, jnp.float32),
                              jnp.asarray(lk, jnp.float32), jnp.asarray(sk, jnp.float32),
                              jnp.asarray(onehot, jnp.float32)))
    np.testing.assert_array_equal(got, want)


def test_classification_data_from_npz_csv_and_bad_input(tmp_path):
    import numpy as np
    from favor.repro import classify

    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = np.repeat([3, 7], 20)
    np.savez(tmp_path / "toy.npz", x=x, y=y)
    np.savetxt(tmp_path / "toy.csv", np.c_[x, y], delimiter=",")
    for path in (tmp_path / "toy.npz", tmp_path / "toy.csv"):
        xs, ys, name = classify.load(str(path))
        assert name == "toy" and xs.shape == (40, 3) and sorted(set(ys)) == [0, 1]   # labels re-indexed
        np.testing.assert_allclose(xs, x, rtol=1e-6)
    data = classify.split(xs, ys, "toy", seed=0)
    assert [len(p[0]) for p in (data.train, data.val, data.test)] == [36, 2, 2]
    np.testing.assert_allclose(data.train[0].mean(0), 0.0, atol=1e-5)               # z-scored on train
    np.savez(tmp_path / "bad.npz", features=x)
    with pytest.raises(ValueError, match="needs arrays x"):
        classify.load(str(tmp_path / "bad.npz"))
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        classify.load(str(tmp_path / "nope.csv"))
    with pytest.raises(ValueError, match="sklearn:iris"):
        classify.load("sklearn:mnist")
    assert main(["crt-classify", "--quick", "--mechanisms", "positive,favor++",
                 "--out", str(tmp_path / "o")]) == 2
