"""`python -m favor.repro`: every reproduction's --quick run writes its three files, its table has the
paper's columns, its figures are finite and the paper's ordering claims hold on them."""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from favor import repro
from favor.repro import report
from favor.repro.__main__ import main

ROOT = Path(__file__).resolve().parents[1]

# the columns each table must carry (the paper's quantity beside favor's)
COLUMNS = {
    "crt-variance": ["regime", "comparison at σ = 1", "paper (log gain)", "favor (log gain)", "agrees"],
    "crt-classify": ["data set", "TrigRF", "PosRF", "OPRF", "PoisRF+", "exact kernel"],
    "simrf-mse": ["quantity", "paper", "favor"],
    "simrf-classify": ["data set", "d", "v̄", "IIDRF", "ORF", "SimRF", "SimRF+", "exact kernel"],
    "hrf-pointwise": ["r", "estimator", "quantity", "paper", "favor (analytic)", "favor (empirical)"],
    "favor-sharp-variance": ["regime", "σ", "GERF (favor: oprf) log(Var/K²)", "SDERF log(Var/K²)"],
    "importance-sampling": ["regime", "σ", "PosRF", "PosRF + IS", "V* (Cor. 2) / Cor. 1 bound"],
    "listops-kernels": ["setting", "accuracy (%)", "Δ vs softmax (± SE)", "seeds"],
    "speech-kernels": ["setting", "WER (%)", "Δ vs softmax (± SE)", "seeds"],
    "mqar-kernels": ["setting", "accuracy (%)", "Δ vs softmax (± SE)", "state (numbers)", "seeds"],
    "uptrain-kernels": ["model", "setting", "day 0 (%)", "after K steps (%)", "Δ vs softmax after K (± SE)", "seeds"],
    "linearize": ["setting", "recipe", "day 0 perplexity", "perplexity", "gap closed (%)", "recall (%)",
                  "trained parameters", "tokens", "seeds"],
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


# the reproductions that train (a sweep of train.py runs under <out>/runs), each with words its quick
# report's comparisons must hold
TRAINED = {"listops-kernels": "LRA Table 1", "speech-kernels": "task check: softmax below the weakest",
           "mqar-kernels": "Zoology: attention solves MQAR", "uptrain-kernels": "task check: the softmax source",
           "linearize": "LoLCATs: transfer + LoRA closes most of the gap"}


def _hashes(folder):
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def _committed_copy(tmp_path, name, monkeypatch):
    """A copy of the checkout's committed repro/<name>/, made the working directory's repro/<name>/, and the
    temporary directories made under tmp_path: a run that wrote to the committed path would change the
    copy, and the real checkout is never at risk."""
    copy = tmp_path / "checkout" / "repro" / name
    shutil.copytree(ROOT / "repro" / name, copy)
    monkeypatch.chdir(tmp_path / "checkout")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return copy


QUICK_SAID = "(a smoke run; the committed figures are untouched)"


@pytest.mark.parametrize("name", sorted(COLUMNS))
def test_quick_run_writes_a_checked_report(name, tmp_path, capsys, monkeypatch):
    """Without --out, from a copy of the committed outputs: the quick run writes a fresh temporary directory
    it names, leaves the committed files byte for byte, and marks its table as a smoke run."""
    monkeypatch.setenv("FAVOR_DATA_DIR", str(tmp_path / "data"))       # the local corpora, built here
    committed = _committed_copy(tmp_path, name, monkeypatch)
    before = _hashes(committed)
    assert main([name, "--quick"]) == 0
    said = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert said.startswith("quick run: wrote ") and said.endswith(QUICK_SAID), said
    paths = said[len("quick run: wrote "):-len(QUICK_SAID) - 1].split(", ")
    out = Path(paths[0]).parent
    assert out.parent == tmp_path and out.name.startswith(f"favor-repro-{name}-quick-"), out
    assert sorted(paths) == sorted(str(out / f"{name}.{ext}") for ext in ("png", "md", "json"))
    assert _hashes(committed) == before
    files = {p.name for p in out.iterdir()}
    assert files == {f"{name}.png", f"{name}.md", f"{name}.json"} | ({"runs"} if name in TRAINED else set()), files
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / f"{name}.json").read_text())
    for col in COLUMNS[name]:
        assert col in data["columns"], (col, data["columns"])
    nums = list(_numbers(data["figures"])) + list(_numbers(data["rows"]))
    assert nums and all(math.isfinite(v) for v in nums), name
    failed = [claim for claim, ok in data["checks"] if not ok]
    assert data["checks"] and not failed, failed
    md = (out / f"{name}.md").read_text()
    assert "| " + " | ".join(data["columns"]) + " |" in md and report.SMOKE in md and data["quick"]
    if name in TRAINED:
        assert any(TRAINED[name] in text for text, _ in data["comparisons"]), data["comparisons"]
        # every run trained on something: a batch whose rows were all dropped has loss 0
        losses = [json.loads(p.read_text())["train_loss"] for p in (out / "runs").rglob("summary.json")]
        assert losses and all(loss > 0 for loss in losses), losses
        # a second call given that directory as --out reuses the finished sweeps there (one, or a source and
        # its uptraining): every run skipped, nothing retrained, the same figures
        listings = sorted((out / "runs").rglob("sweep.json"))
        runs = {p.parent: json.loads(p.read_text())["runs"] for p in listings}
        assert main([name, "--quick", "--out", str(out)]) == 0
        assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith(f"wrote {out / name}.")
        for where, listed in runs.items():
            log = (where / "sweep.log").read_text().split("### ")[-1]
            assert log.count("finished already; skipped") == len(listed) and "started run" not in log, log
        assert json.loads((out / f"{name}.json").read_text())["figures"] == data["figures"]


def test_out_is_where_asked_and_only_a_full_run_defaults_to_the_committed_outputs(tmp_path, capsys, monkeypatch):
    """An explicit --out is written, even at the committed path and with --quick; a full run without it
    writes repro/<name>; a quick run refused before writing leaves no temporary directory behind."""
    name = "simrf-mse"
    committed = _committed_copy(tmp_path, name, monkeypatch)
    before = _hashes(committed)
    module = repro.get(name)
    done = report.Report(title="t", protocol="p", columns=["a"], rows=[[1.0]], figures={}, plot=lambda fig: None)
    monkeypatch.setattr(module, "run", lambda args: done)
    assert main([name, "--quick", "--out", f"repro/{name}"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith(f"wrote repro/{name}/{name}.")
    assert _hashes(committed).keys() == before.keys() and report.SMOKE in (committed / f"{name}.md").read_text()
    assert main([name, "--out", str(tmp_path / "asked")]) == 0
    assert report.SMOKE not in (tmp_path / "asked" / f"{name}.md").read_text()
    (committed / f"{name}.md").write_text("stale")
    assert main([name]) == 0
    md = (committed / f"{name}.md").read_text()
    assert md.startswith("## t") and report.SMOKE not in md

    def refused(args):
        raise ValueError("refused")
    monkeypatch.setattr(module, "run", refused)
    assert main([name, "--quick"]) == 2 and "error: refused" in capsys.readouterr().err
    assert not list(tmp_path.glob("favor-repro-*"))


def test_a_reproduction_that_trains_loads_the_checkouts_configs_from_any_directory(tmp_path):
    """`python -m favor.repro linearize` run outside the checkout: its config imports its sibling
    (`from configs import decoder_lm`) and the run gets as far as the sweep, here one of another config
    in --workdir, refused on one line with exit code 2 (no traceback, no empty directory left)."""
    (tmp_path / "runs" / "source").mkdir(parents=True)
    (tmp_path / "runs" / "source" / "sweep.json").write_text(json.dumps({"config": "configs/other.py"}))
    done = subprocess.run([sys.executable, "-m", "favor.repro", "linearize", "--quick", "--workdir", "runs"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "holds the sweep of another config" in lines[0], lines
    assert not list(tmp_path.glob("favor-repro-*"))


def test_list_names_every_reproduction(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in repro.names())


def test_unknown_reproduction_is_a_clear_error(capsys):
    assert main(["crt-varience"]) == 2
    err = capsys.readouterr().err
    assert "crt-varience" in err and "crt-variance" in err


def test_trained_comparisons_match_a_hand_computed_welch_z():
    """trained.rate: z = (mean_a − mean_b) / √(sd_a²/n_a + sd_b²/n_b), sample sd, in the claim's direction."""
    import numpy as np
    from favor.repro import trained

    a, b = (0.36, 0.33, 0.35), (0.18, 0.25, 0.16, 0.20)
    z = (np.mean(a) - np.mean(b)) / np.sqrt(np.var(a, ddof=1) / 3 + np.var(b, ddof=1) / 4)
    verdict, got = trained.rate(trained.Stat(a), trained.Stat(b))
    assert verdict == "agrees" and got == pytest.approx(z, rel=1e-12)
    assert trained.rate(trained.Stat(b), trained.Stat(a)) == ("disagrees", pytest.approx(-z, rel=1e-12))
    # lower is better (a WER): the claim "a beats b" reads the difference the other way
    assert trained.rate(trained.Stat(b), trained.Stat(a), higher_is_better=False)[0] == "agrees"
    close = trained.rate(trained.Stat((0.30, 0.34)), trained.Stat((0.31, 0.35)))
    assert close[0] == "within noise" and -2 < close[1] < 0
    assert trained.rate(trained.Stat((0.5, 0.5)), trained.Stat((0.5, 0.5))) == ("within noise", 0.0)


def _fake_run(name, kind, seed, accuracy, window=0, layers=2, metric="accuracy", **config):
    from favor.tools.report import RunRecord
    config = {"model.attention.kind": kind, "model.attention.window": window, "model.num_layers": layers,
              "seed": seed, "total_steps": 1000, **config}
    return RunRecord(name, None, config=config, status="finished", step=1000,
                     summary={"step": 1000, metric: accuracy, "steps_per_second": None if seed else 5.0,
                              "num_params": 1234},
                     curves={f"eval/{metric}": [(500, accuracy - 0.01), (1000, accuracy)]})


def test_listops_report_groups_the_settings_and_rates_them_by_hand_computed_z():
    """listops-kernels' grouping and claims on made-up finished runs: the window hybrid and the bag of tokens
    are settings of their own, Δ vs softmax and each z are the hand-computed Welch figures, and a setting
    the sweep was asked for but lacks fails the check."""
    import numpy as np
    from favor.repro import listops_kernels as lk, trained

    acc = {("softmax", 0): (0.330, 0.340, 0.335), ("favor+", 0): (0.200, 0.215, 0.190),
           ("favor++", 0): (0.300, 0.330, 0.310), ("favor++", 32): (0.320, 0.325, 0.318),
           ("bag", 0): (0.171, 0.171, 0.171)}
    runs = [_fake_run(f"{k}{w}_{s}", "softmax" if k == "bag" else k, s, a, window=w, layers=0 if k == "bag" else 2)
            for (k, w), values in acc.items() for s, a in enumerate(values)]
    settings = trained.by_setting(runs, lk._label, "accuracy")
    hybrid = "FAVOR++ + softmax band ±32"
    assert list(settings) == ["softmax", "FAVOR+", "FAVOR++", hybrid, lk.BAG]
    asked = ["softmax", "FAVOR+", "FAVOR++", hybrid, lk.BAG]
    rep = lk._report(settings, runs, "/x/configs/listops.py:window=256,seeds=3", "256", 3, 32, asked)
    rows = {r[0]: r for r in rep.rows}
    a, b = np.array(acc[("favor+", 0)]), np.array(acc[("softmax", 0)])
    se = np.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 3)
    assert rows["FAVOR+"][2] == f"{100 * (a.mean() - b.mean()):+.1f} ± {100 * se:.1f}"
    assert rows["FAVOR+"][3] == "5" and [r[0] for r in rep.rows][0] == "softmax"     # best first
    lra = next((t, v) for t, v in rep.comparisons if "LRA Table 1" in t)
    assert lra[1] == "agrees" and f"z = {(b.mean() - a.mean()) / se:.1f}" in lra[0], lra
    floor = next((t, v) for t, v in rep.comparisons if "bag of tokens" in t)
    assert floor[1] == "agrees"            # the bag's sd is 0: the softmax side alone sets the SE
    h, p = np.array(acc[("favor++", 32)]), np.array(acc[("favor++", 0)])
    z = (h.mean() - p.mean()) / np.sqrt(h.var(ddof=1) / 3 + p.var(ddof=1) / 3)
    band = next((t, v) for t, v in rep.comparisons if t.startswith(hybrid))
    assert "FAVOR++ alone" in band[0] and band[1] == trained.rate(trained.Stat(tuple(h)), trained.Stat(tuple(p)))[0]
    assert f"z = {z:.1f}" in band[0] and abs(z) < 2 and band[1] == "within noise"
    weakest = next(t for t, _ in rep.comparisons if "weakest" in t)
    assert "FAVOR+ (" in weakest                                      # the lowest random-feature mean
    assert rep.checks[0][1] is True
    missing = lk._report(settings, runs, "/x/configs/listops.py:seeds=3", "256", 3, 32, asked + ["ELU"])
    assert missing.checks[0][1] is False
    # the sweep's cost comes from the launcher's records: first start to last end, runs at once
    for i, r in enumerate(runs):
        r.sweep_status = {"started": 1000.0 + 60 * i, "ended": 1000.0 + 60 * i + 150, "parallel": 2}
    timed = lk._report(settings, runs, "/x/configs/listops.py:seeds=3", "256", 3, 32, asked)
    assert f"{len(runs)} runs in {(60 * (len(runs) - 1) + 150) / 60:.0f} min of wall clock, 2 at a time" \
        in timed.notes[0] and "`configs/listops.py:seeds=3`" in timed.notes[0]
    assert "wall clock" not in rep.notes[0]                            # no records: no figure
    # a sweep resumed a day later counts the time some run was going, not the pause between sessions
    for i, r in enumerate(runs):
        r.sweep_status = {"started": 1000.0 + 60 * i + (86_400 if i >= 3 else 0), "parallel": 2}
        r.sweep_status["ended"] = r.sweep_status["started"] + 150
    busy = (60 * 2 + 150) + (60 * (len(runs) - 4) + 150)
    resumed = lk._report(settings, runs, "/x/configs/listops.py:seeds=3", "256", 3, 32, asked)
    assert f"{len(runs)} runs in {busy / 60:.0f} min of wall clock" in resumed.notes[0], resumed.notes[0]
    # nested, overlapping and identical starts: the union of the intervals, 0-1,100 s and 5,000-5,060 s
    from types import SimpleNamespace
    spans = [(0, 1000), (100, 200), (900, 1100), (900, 950), (5000, 5060)]
    timed = [SimpleNamespace(sweep_status={"started": a, "ended": b, "parallel": 1}) for a, b in spans]
    assert trained.timing(timed) == ", 5 runs in 19 min of wall clock, 1 at a time"
    assert trained.timing(timed[:2]) == ", 2 runs in 17 min of wall clock, 1 at a time"   # 1,000 s, not 1,100


def test_speech_report_labels_kinds_by_width_and_rates_wer_lower_is_better():
    """speech-kernels on made-up finished runs: HRF's λ estimator and the width name each setting, the model
    without attention is a setting of its own, WER claims are rated lower-is-better with the hand-computed
    Welch z, and the table is sorted best (lowest WER) first."""
    import numpy as np
    from favor.repro import speech_kernels as sk, trained

    wer = {("softmax", 16, "angular", True): (0.10, 0.12, 0.11), ("favor+", 16, "angular", True): (0.30, 0.28, 0.33),
           ("favor++", 16, "angular", True): (0.20, 0.22, 0.19), ("hrf", 64, "cluster", True): (0.25, 0.26, 0.24),
           ("hrf", 64, "angular", True): (0.40, 0.45, 0.42), ("softmax", 16, "angular", False): (0.60, 0.62, 0.61)}
    runs = [_fake_run(f"{k}{m}{lam}{att}_{s}", k, s, w, metric="wer", **{
        "model.attention.num_features": m, "model.attention.lambda_": lam, "model.self_attention": att,
        "model.attention.qk_norm": "l2" if k == "hrf" else ""})
        for (k, m, lam, att), values in wer.items() for s, w in enumerate(values)]
    settings = trained.by_setting(runs, sk._label, "wer")
    assert list(settings) == ["softmax", "FAVOR+ M=16", "FAVOR++ M=16", "HRF-cluster M=64 (qk l2)",
                              "HRF-angular M=64 (qk l2)", sk.FLOOR]
    rep = sk._report(settings, runs, "/x/configs/conformer_librispeech.py:data=hard,seeds=3", 3, 64, list(settings))
    assert [r[0] for r in rep.rows][0] == "softmax" and rep.rows[-1][0] == sk.FLOOR      # lowest WER first
    crt = next((t, v) for t, v in rep.comparisons if "at M = 16" in t)
    a, b = np.array(wer[("favor++", 16, "angular", True)]), np.array(wer[("favor+", 16, "angular", True)])
    z = (b.mean() - a.mean()) / np.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 3)
    assert crt[1] == "agrees" and f"z = {z:.1f}" in crt[0] and "the paper's gap 3.05 points" in crt[0], crt
    assert f"WER: {100 * (b.mean() - a.mean()):+.1f} ± {100 * np.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 3):.1f}" \
        in crt[0], crt                                            # worse minus better: a gain is positive
    hrf = next((t, v) for t, v in rep.comparisons if t.startswith("HRF-cluster M=64 (qk l2) ("))
    assert hrf[1] == "agrees", hrf
    floor = next((t, v) for t, v in rep.comparisons if "without attention" in t)
    assert floor[1] == "agrees"
    weakest = next(t for t, _ in rep.comparisons if "weakest" in t)
    assert "HRF-angular M=64 (qk l2) (" in weakest                        # the highest random-feature WER
    assert rep.checks[0][1] is True
    missing_trig = sk._report(settings, runs, "/x/c.py:seeds=3", 3, 64, list(settings) + ["trig M=64 (qk l2)"])
    assert missing_trig.checks[0][1] is False
    # a claim whose settings this sweep lacks is named as not rated, never dropped silently
    assert any("Not rated" in n and "FAVOR# M=16" in n and "trig M=64 (qk l2)" in n for n in rep.notes), rep.notes


def test_every_speech_claim_names_settings_the_sweep_asks_for():
    """Each paper claim compares two settings of the default sweep (a mistyped label would leave the claim
    unrated), and FAVOR#'s claims follow the widest narrow width, where the sweep puts FAVOR#."""
    from favor.repro import speech_kernels as sk

    for widths, wide in (([8, 16], 64), ([8, 32], 128)):
        asked = set(sk.asked_settings(widths, wide, quick=False))
        pairs = sk.claim_settings(wide, widths[-1])
        assert len(pairs) == len(sk.PAPER_CLAIMS)
        missing = [p for p in pairs if not set(p) <= asked]
        # the CRT claims are at the paper's M = 8 and 16; every other claim is always in the sweep
        assert all(p[0].startswith("FAVOR++ M=16") for p in missing) and len(missing) == (widths[-1] != 16), missing


def test_speech_sweep_settings_are_valid_configs():
    """Every run of the full speech sweep is an override set train.py accepts (applied to the config and
    validated as a run is), giving the settings the report expects, 3 seeds each; the quick sweep is the
    tests' four runs."""
    from favor import job
    from favor.config import loading
    from favor import sweeps
    from favor.repro import speech_kernels as sk, trained
    from favor.tools.report import RunRecord

    # the config string the full entry builds, its defaults
    spec = trained.config_path("conformer_librispeech.py") + ":seeds=3,narrow=8/16,wide=64,conv_kernel=1,data=hard," \
        "steps=300"
    runs = sweeps.load(spec)
    labels = []
    for run in runs:
        config = loading.load(spec)
        for key, value in run.overrides.items():
            loading.apply_flag(config, f"{key}={value}")
        job.validate(config)
        assert config.total_steps == 300 and config.data.dataset == "local:hard" and config.model.conv_kernel == 1
        record = RunRecord(run.name, None, config={"model.attention.kind": config.model.attention.kind,
                                                   "model.attention.num_features": config.model.attention.num_features,
                                                   "model.attention.lambda_": config.model.attention.lambda_,
                                                   "model.attention.qk_norm": config.model.attention.qk_norm,
                                                   "model.self_attention": config.model.self_attention})
        # the sign-indefinite kinds on the sphere, the others as the papers ran them
        assert (config.model.attention.qk_norm == "l2") == (config.model.attention.kind in ("favor", "hrf"))
        labels.append(sk._label(record))
    asked = sk.asked_settings([8, 16], 64, quick=False)
    assert sorted(set(labels)) == sorted(asked) and all(labels.count(k) == 3 for k in asked)
    assert len(runs) == 33
    # seed by seed: the first pass runs every setting once (parallel runs are then different programs)
    assert [r.overrides["seed"] for r in runs] == [s for s in range(3) for _ in range(11)]
    assert len(set(labels[:11])) == 11
    path = trained.config_path("conformer_librispeech.py")
    assert len(sweeps.load(path + ":data=hard,runlocal,quick,floor=False,seeds=2")) == 4
    # a wide width equal to a narrow one: FAVOR+ there once, as the report asks for it
    same = sweeps.load(path + ":data=hard,steps=400,wide=16")
    assert len(same) == 3 * len(sk.asked_settings([8, 16], 16, quick=False)) == 30
    for bad in ("steps=-1", "conv_kernel=-3", "runlocal,steps=400"):
        with pytest.raises(ValueError, match="steps=|conv_kernel="):
            loading.load(path + ":data=hard," + bad)
    assert loading.load(path + ":data=hard,runlocal").data.dataset == "local:hard_tiny"


def test_trained_reproduction_rejects_one_seed_and_a_failed_sweep(tmp_path, capsys, monkeypatch):
    assert main(["listops-kernels", "--quick", "--seeds", "1", "--out", str(tmp_path / "o")]) == 2
    assert "--seeds 1" in capsys.readouterr().err
    assert main(["mqar-kernels", "--widths", "16/x", "--out", str(tmp_path / "o")]) == 2
    assert "--widths '16/x': expected positive integers" in capsys.readouterr().err
    for bad in (["--narrow", "8/x"], ["--wide", "0"], ["--conv-kernel", "0"], ["--steps", "5"]):
        assert main(["speech-kernels", "--quick", *bad, "--out", str(tmp_path / "o")]) == 2
        assert bad[1] in capsys.readouterr().err, bad
    from favor.repro import trained
    listops = trained.config_path("listops.py")
    with pytest.raises(trained.SweepError, match=r"failed before starting a run.*kinds: unknown 'no-such-kind'"):
        trained.run_sweep(listops + ":runlocal,kinds=no-such-kind,seeds=2,band=0", tmp_path / "bad", parallel=1)
    # runs that start and fail: named, with the way to resume
    one = listops + ":runlocal,kinds=softmax,seeds=2,band=0,floor=False"
    with pytest.raises(trained.SweepError, match=r"did not finish.*kind=softmax_seed=0: failed.*Rerun the same"):
        trained.run_sweep(one, tmp_path / "fails", parallel=2, extra=["--config.model.attention.kind=nope"])
    # a workdir that holds another config's sweep, or the same config's with other flags, is never mixed
    # into this one
    with pytest.raises(trained.SweepError, match=r"holds the sweep of another config"):
        trained.run_sweep(one.replace("seeds=2", "seeds=3"), tmp_path / "fails", parallel=1)
    with pytest.raises(trained.SweepError, match=r"holds the sweep of another config .*kind=nope\); this one is"):
        trained.run_sweep(one, tmp_path / "fails", parallel=1, extra=["--config.total_steps=3"])
    for bad, said in ((["--sides", "vit/gpt"], "--sides: unknown 'gpt'"), (["--seeds", "1"], "--seeds 1"),
                      (["--vit-steps", "5"], "--vit-steps 5 with --quick"), (["--kinds", "favor#:nope"], "nope"),
                      (["--kinds", "favor#/favor#:sderf"], "two specs name one setting")):
        assert main(["uptrain-kernels", "--quick", *bad, "--out", str(tmp_path / "u")]) == 2
        assert said in capsys.readouterr().err, bad
    assert not (tmp_path / "u").exists()              # refused before any source trained


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
    # a header line or text labels: a clear error naming the file and the expected layout
    (tmp_path / "header.csv").write_text("a,b,c,label\n" + "\n".join(f"{i},{i},{i},{i % 2}" for i in range(6)))
    (tmp_path / "words.csv").write_text("\n".join(f"{i},{i},{i},{'cat' if i % 2 else 'dog'}" for i in range(6)))
    for bad in ("header.csv", "words.csv"):
        with pytest.raises(ValueError, match=rf"{bad}.*integer class label in the last column.*no header"):
            classify.load(str(tmp_path / bad))
    (tmp_path / "frac.csv").write_text("\n".join(f"{i},{i},{i + 0.5}" for i in range(6)))
    with pytest.raises(ValueError, match="frac.csv.*integer class labels"):
        classify.load(str(tmp_path / "frac.csv"))
    assert main(["crt-classify", "--quick", "--mechanisms", "positive,favor++",
                 "--out", str(tmp_path / "o")]) == 2


def test_crt_classify_runs_every_mechanism_and_prints_the_papers_table(tmp_path):
    """Every registered mechanism (all estimate the kernel) runs through crt-classify on iris with a tiny
    protocol, and the paper's Table 1 (its eight sets and its Average row) fills the columns of the
    paper's mechanisms, GERF's included."""
    from favor import kernels
    from favor.repro import crt_classify

    names = kernels.names()
    out = tmp_path / "all"
    assert main(["crt-classify", "--quick", "--seeds", "2", "--sigmas", "1", "--mechanisms", ",".join(names),
                 "--out", str(out)]) == 0
    data = json.loads((out / "crt-classify.json").read_text())
    cols = data["columns"]
    labels = [crt_classify.LABELS.get(n, n) for n in names]
    assert cols == ["data set"] + labels + ["exact kernel", "train size"]
    res = data["figures"]["results"]["iris"]
    assert all(0.0 <= res[lab]["mean"] <= 1.0 for lab in labels)
    rows = {r[0]: r for r in data["rows"]}
    assert set(crt_classify.PAPER_TABLE) == {"abalone", "banknote", "car", "yeast", "cmc", "nursery", "wifi",
                                             "chess", "Average"}
    for dname, accs in crt_classify.PAPER_TABLE.items():
        row = next(r for k, r in rows.items() if k.startswith(f"paper: {dname} "))
        for n, lab in zip(names, labels):
            want = f"{accs[n]:.1f}" if n in accs else None
            assert row[cols.index(lab)] == want, (dname, lab, row[cols.index(lab)], want)
    # the paper's Average row is its own, and is the mean of its eight rows (to its rounding)
    import numpy as np
    for n, a in crt_classify.PAPER_AVERAGE.items():
        rows8 = [crt_classify.PAPER_TABLE[k][n] for k in crt_classify.PAPER_TABLE if k != "Average"]
        assert abs(np.mean(rows8) - a) <= 0.051, (n, np.mean(rows8), a)
    assert crt_classify.PAPER_AVERAGE["oprf"] == 57.8 and crt_classify.PAPER_AVERAGE["trig"] == 35.5
    md = (out / "crt-classify.md").read_text()
    assert "GERF 56.1" in md and "m = " in md          # notes from this run: the paper's GERF, HRF's m


def test_crt_classify_notes_follow_the_run(tmp_path):
    """Notes name only mechanisms in the run and the budget given."""
    out = tmp_path / "o"
    assert main(["crt-classify", "--quick", "--seeds", "2", "--sigmas", "1", "--budget", "64",
                 "--mechanisms", "positive,oprf", "--out", str(out)]) == 0
    md = (out / "crt-classify.md").read_text().split("Claims of the paper")[1]     # the notes, not --help
    assert "SDERF" not in md and "HRF" not in md and "TrigRF is last" not in md
    assert "budget of 64" in md and "OPRF 57.8 > PosRF 54.3" in md


def test_shift_eps_option_keeps_the_library_default():
    import jax.numpy as jnp
    from favor import kernels
    from favor.kernels import discrete

    x = jnp.asarray([[1.0, 2.0], [3.0, 5.0]])
    for name in ("poisson+", "geometric+"):
        assert kernels.options(name) == {"shift_eps": discrete.SHIFT_EPS} and discrete.SHIFT_EPS == 1e-2
        c = kernels.get(name).fit(x, x).shift
        assert jnp.allclose(c, jnp.asarray([1.0, 2.0]) - 1e-2)
        c8 = kernels.get(name, shift_eps=0.5).fit(x, x).shift
        assert jnp.allclose(c8, jnp.asarray([0.5, 1.5]))
        with pytest.raises(ValueError, match="shift_eps"):
            kernels.get(name, shift_eps=0.0)
    assert kernels.options("poisson") == {} and kernels.options("geometric") == {}


def test_simrf_classify_compares_the_papers_ordering(tmp_path):
    out = tmp_path / "s"
    assert main(["simrf-classify", "--quick", "--seeds", "3", "--out", str(out)]) == 0
    data = json.loads((out / "simrf-classify.json").read_text())
    comps = data["comparisons"]
    assert len(comps) == 2 and all(v in ("agrees", "within noise", "disagrees") for _, v in comps)
    assert all("± " in t and "z = " in t for t, _ in comps)
    paper_wifi = next(r for r in data["rows"] if r[0].startswith("paper: wifi"))
    assert paper_wifi[2] == 0.8 and paper_wifi[5] == "0.6314 ± 0.0018"


def test_mqar_report_measures_state_sizes_and_rates_recall_against_them(tmp_path):
    """mqar-kernels: each setting's state is the numbers its decoding cache holds (checked against the
    count by hand: softmax keeps 2·layers·L·d_model, a linear kind layers·heads·F·(head dim + 2), a band
    adds its w + 1 keys, values, log-features and positions, (w + 1)·(2·head dim + F + 1), per head and layer); on made-up runs the settings group by kind and
    width, and the state, band and FAVOR# claims are rated with the hand-computed Welch z."""
    import numpy as np
    from favor.config import loading
    from favor.repro import mqar_kernels as mk, trained

    path = trained.config_path("mqar.py")
    layers, heads, d_model, length = 2, 2, 64, 64
    head = d_model // heads
    expect = {("softmax", 64, 0): 2 * layers * length * d_model,
              ("favor+", 16, 0): layers * heads * 16 * (head + 2),
              ("favor#", 256, 0): layers * heads * 256 * (head + 2),
              ("elu", 64, 0): layers * heads * head * (head + 2),
              ("favor+", 64, 8): layers * heads * (64 * (head + 2) + 9 * (1 + 64 + 2 * head))}
    for (kind, f, w), numbers in expect.items():
        c = loading.load(f"{path}:kind={kind},num_features={f},window={w}")
        assert mk.state_numbers(c) == numbers, (kind, f, w)

    acc = {("softmax", 64, 0): (0.95, 0.97, 0.96), ("favor+", 16, 0): (0.10, 0.12, 0.11),
           ("favor+", 256, 0): (0.30, 0.34, 0.32), ("favor#", 16, 0): (0.11, 0.13, 0.10),
           ("favor#", 256, 0): (0.31, 0.33, 0.35), ("favor+", 64, 8): (0.40, 0.45, 0.42),
           ("favor+", 64, 0): (0.20, 0.22, 0.21)}
    runs = []
    for (kind, f, w), values in acc.items():
        for seed, a in enumerate(values):
            r = _fake_run(f"{kind}{f}{w}_{seed}", kind, seed, a, window=w, **{"model.attention.num_features": f})
            runs.append(r)
    settings = trained.by_setting(runs, mk._label, "accuracy")
    assert set(settings) == {"softmax", "FAVOR+ F=16", "FAVOR+ F=256", "FAVOR# F=16", "FAVOR# F=256",
                             "FAVOR+ F=64 + band 8", "FAVOR+ F=64"}
    sizes = {k: 1000 + i for i, k in enumerate(settings)}
    rep = mk._report(settings, sizes, runs, f"{path}:seeds=3", 3, sorted(settings), pairs=4)
    assert rep.checks[0][1] is True
    # above 1 / pairs = 25 % at 2 SE: softmax, FAVOR+ and FAVOR# at 256 (~32 %) and the band (~42 %)
    assert rep.notes[1].endswith("(association): softmax, FAVOR+ F=256, FAVOR# F=256, FAVOR+ F=64 + band 8."), rep.notes
    assert {r[0]: r[3] for r in rep.rows} == sizes
    more = next((t, v) for t, v in rep.comparisons if t.startswith("Zoology: more state") and "FAVOR+ F=256" in t)
    a, b = np.array(acc[("favor+", 256, 0)]), np.array(acc[("favor+", 16, 0)])
    z = (a.mean() - b.mean()) / np.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 3)
    assert more[1] == "agrees" and f"z = {z:.1f}" in more[0] and "> FAVOR+ F=16" in more[0]
    band = next((t, v) for t, v in rep.comparisons if t.startswith("FAVOR+ F=64 + band 8"))
    assert band[1] == "agrees" and "FAVOR+ F=64 alone" in band[0]
    sharp = next((t, v) for t, v in rep.comparisons if t.startswith("FAVOR# F=256"))
    assert sharp[1] == "within noise" and "> FAVOR+ F=256" in sharp[0]
    solved = next((t, v) for t, v in rep.comparisons if "solves" in t)
    s = np.array(acc[("softmax", 64, 0)])
    assert solved[1] == "agrees" and f"z = {(s.mean() - 0.9) / (s.std(ddof=1) / np.sqrt(3)):.1f}" in solved[0]
    assert mk._report(settings, sizes, runs, f"{path}:seeds=3", 3, sorted(settings) + ["ELU"]).checks[0][1] is False
    assert mk.asked_settings(("favor+", "elu"), [16, 64, 256], [8], ("hrf", "favor+", "relu")) == [
        "softmax", "FAVOR+ F=16", "FAVOR+ F=64", "FAVOR+ F=256", "ELU", "HRF (qk l2) F=64", "ReLU", "FAVOR+ F=64 + band 8"]
    hrf = _fake_run("h", "hrf", 0, 0.3, **{"model.attention.num_features": 64, "model.attention.qk_norm": "l2"})
    assert mk._label(hrf) == "HRF (qk l2) F=64"
    # the sweep's runs carry exactly the labels the report asks for (kinds, others, bands, l2 on trig/HRF)
    from types import SimpleNamespace
    from favor import sweeps
    spec = f"{path}:seeds=1,kinds=favor/elu/favor+,others=hrf/relu/favor+/simrf,widths=8/32/128,bands=4"
    labels = sorted(mk._label(SimpleNamespace(settings=r.overrides)) for r in sweeps.load(spec))
    assert labels == sorted(mk.asked_settings(("favor", "elu", "favor+"), [8, 32, 128], [4],
                                              ("hrf", "relu", "favor+", "simrf")))
    assert "trig (qk l2) F=128" in labels and "HRF (qk l2) F=32" in labels and "FAVOR+ F=32 + band 4" in labels


def test_uptrain_report_reads_day_0_at_step_0_and_rates_each_side_by_hand_computed_z():
    """uptrain-kernels on made-up finished runs: day 0 is each run's step-0 evaluation and "after K" its
    final one, FAVOR#'s variant names the setting (no variant: SDERF), each claim's z is the hand-computed
    Welch figure, a claim that is another model's is named as carried over to the ViT, and a BERT source
    below 30 % masked-token accuracy fails its check."""
    import numpy as np
    from favor.repro import trained, uptrain_kernels as uk
    from favor.tools.report import RunRecord

    def run(kind, seed, day0, final, variant=None):
        config = {"model.attention.kind": kind, "seed": seed, "total_steps": 300}
        if variant is not None:
            config["model.attention.variant"] = variant
        return RunRecord(f"{kind}{variant}{seed}", None, config=config, status="finished", step=300,
                         summary={"step": 300, "accuracy": final, "steps_per_second": 4.0},
                         curves={"eval/accuracy": [(0, day0), (150, (day0 + final) / 2), (300, final)]})

    figures = {("softmax", None): ((0.95, 0.95, 0.95), (0.96, 0.97, 0.965)),
               ("favor+", None): ((0.30, 0.45, 0.38), (0.88, 0.91, 0.90)),
               ("favor++", None): ((0.55, 0.60, 0.62), (0.95, 0.96, 0.955)),
               ("favor#", "saderf"): ((0.50, 0.52, 0.40), (0.94, 0.95, 0.96)),
               ("favor#", ""): ((0.93, 0.94, 0.95), (0.96, 0.96, 0.97))}
    runs = [run(k, s, d, f, v) for (k, v), (day0, final) in figures.items() for s, (d, f) in enumerate(zip(day0, final))]
    settings = trained.by_setting(runs, uk._label, "accuracy")
    assert list(settings) == ["softmax", "FAVOR+", "FAVOR++", "FAVOR# (SADERF)", "FAVOR# (SDERF)"]

    def source(value):
        return RunRecord("src", None, config={}, status="finished", step=3000,
                         summary={"step": 3000, "accuracy": value}, curves={})

    side = {"source": ("/c/configs/default.py:seeds=1,kinds=softmax", []), "steps": 300, "metric": "accuracy",
            "uptrain": ("/c/configs/default.py:seeds=3,kinds=x", ["--config.total_steps=300"]), "seeds": 3,
            "asked": list(settings), "source_run": source(0.96), "runs": runs, "settings": settings}
    rep = uk._report({"vit": side, "bert": {**side, "source_run": source(0.25)}})
    row = next(r for r in rep.rows if r[:2] == ["digits ViT", "FAVOR++"])
    assert row[2] == "59.0 ± 3.6" and row[3] == "95.5 ± 0.5"
    pp, p = np.array(figures[("favor++", None)][1]), np.array(figures[("favor+", None)][1])   # after K
    z = (pp.mean() - p.mean()) / np.sqrt(np.var(pp, ddof=1) / 3 + np.var(p, ddof=1) / 3)
    claim = next((t, v) for t, v in rep.comparisons if t.startswith("digits ViT, after 300 steps: FAVOR++"))
    assert f"(z = {z:.1f})" in claim[0] and claim[1] == "agrees", claim
    pp, p = np.array(figures[("favor++", None)][0]), np.array(figures[("favor+", None)][0])   # day 0
    z = (pp.mean() - p.mean()) / np.sqrt(np.var(pp, ddof=1) / 3 + np.var(p, ddof=1) / 3)
    claim = next(t for t, _ in rep.comparisons if t.startswith("digits ViT, day 0: FAVOR++"))
    assert f"(z = {z:.1f})" in claim and "not a figure of the paper" in claim, claim
    # the BERT-MLM's head is the source's: day 0 rated on both sides; a weak source is said beside each claim
    bert = [t for t, _ in rep.comparisons if t.startswith("BERT-MLM")]
    assert any("day 0" in t for t in bert)
    assert all("read with care" in t for t in bert if "task check" not in t)
    # FAVOR# Table 1 is a BERT claim: rated on both, named as the paper's on the BERT side only
    sharp = [t for t, _ in rep.comparisons if "FAVOR# (SADERF)" in t and "> FAVOR+ (" in t and "after" in t]
    assert len(sharp) == 2 and sum("here on the digits ViT" in t for t in sharp) == 1
    assert [ok for claim, ok in rep.checks if "masked-token" in claim] == [False]
    assert all(ok for claim, ok in rep.checks if "masked-token" not in claim)
    incomplete = uk._report({"vit": {**side, "asked": list(settings) + ["ELU"]}})
    assert incomplete.checks[0][1] is False
    with pytest.raises(trained.SweepError, match="no step-0"):
        uk.day0(_fake_run("x", "favor+", 0, 0.5), "accuracy")


def test_uptrain_sweeps_give_the_settings_the_report_asks_for():
    """The settings uptrain-kernels asks for are the labels its sweeps' runs get (each side's uptraining sweep,
    loaded from its config as the launcher does), for the default kinds and for specs whose variant is
    left to the kind (favor# is FAVOR# (SDERF), hrf HRF (angular))."""
    import argparse
    from favor import sweeps
    from favor.repro import uptrain_kernels as uk
    from favor.tools.report import RunRecord

    for kinds in (None, "favor#/hrf/favor+@8/simrf:positive/elu"):
        args = argparse.Namespace(quick=False, seeds=3, sides=None, kinds=kinds, vit_steps=None, bert_steps=None,
                                  bert_source_steps=None, parallel=2)
        for side, p in uk.plan(args).items():
            runs = sweeps.load(p["uptrain"][0])
            labels = [uk._label(RunRecord(r.name, None, config=dict(r.overrides))) for r in runs]
            assert sorted(set(labels)) == sorted(p["asked"]) and all(labels.count(k) == 3 for k in p["asked"]), side
    assert uk.plan(args)["vit"]["asked"] == ["softmax", "FAVOR# (SDERF)", "HRF (angular)", "FAVOR+ + band 8",
                                             "SimRF (positive)", "ELU"]


def test_linearize_report_reads_day_0_the_gap_closed_and_rates_by_hand_computed_z():
    """linearize on made-up finished runs: settings are named by kind, band and recipe; day 0 is the step-0
    evaluation; the gap closed is (day 0 − final) / (day 0 − source) per seed; each claim's z is the
    hand-computed Welch figure in the direction "lower perplexity"; recall and the trained share come from
    what each run measured."""
    import numpy as np
    from favor.repro import linearize as lin
    from favor.tools.report import RunRecord

    def run(kind, window, recipe, seed, day0, final):
        config = {"model.attention.kind": kind, "model.attention.window": window, "seed": seed, "total_steps": 300,
                  "batch_size": 16, "data.max_length": 128, "uptrain.finetune": "lora" if recipe == "lolcats" else "all"}
        return RunRecord(f"{kind}{window}{recipe}{seed}", None, config=config, status="finished", step=300,
                         summary={"step": 300, "perplexity": final, "trainable_params": 100 if recipe == "lolcats" else 5000,
                                  "trainable_fraction": 0.02 if recipe == "lolcats" else 1.0},
                         curves={"eval/perplexity": [(0, day0), (300, final)]})

    figures = {("hedgehog", 0, "lolcats"): ((300.0, 310.0), (80.0, 90.0)),
               ("hedgehog", 16, "lolcats"): ((200.0, 210.0), (60.0, 61.0)),
               ("favor+", 0, "lolcats"): ((400.0, 420.0), (120.0, 130.0)),
               ("favor#", 0, "lolcats"): ((250.0, 260.0), (100.0, 104.0)),
               ("softmax", 16, "lolcats"): ((70.0, 70.0), (66.0, 67.0)),
               ("hedgehog", 0, "full"): ((300.0, 310.0), (70.0, 75.0))}
    runs = [run(k, w, r, s, d, f) for (k, w, r), (day0, final) in figures.items()
            for s, (d, f) in enumerate(zip(day0, final))]
    source = RunRecord("src", None, config={"data.mix_in.name": "mqar", "data.mix_in.num_pairs": 8,
                                            "data.mix_in.vocab_size": 256, "data.mix_rate": 0.25},
                       status="finished", step=1500, summary={"step": 1500, "perplexity": 50.0}, curves={})
    # the band alone recalls the most of the students: it is not a "linear kind without a band"
    measured = {("softmax", 16): (0.70, 0.74), ("hedgehog", 0): (0.40, 0.46), ("favor#", 0): (0.55, 0.61)}
    recall = {r.name: measured.get((r.config["model.attention.kind"], r.config["model.attention.window"]),
                                   (0.5, 0.52))[r.config["seed"]] for r in runs} | {"src": 0.9}
    p = {"source": "/c/configs/linearize.py:stage=source", "sweep": "/c/configs/linearize.py:seeds=2",
         "seeds": 2, "asked": sorted({lin._label(r) for r in runs})}
    rep = lin._report(p, source, runs, recall)
    row = next(r for r in rep.rows if r[:2] == ["Hedgehog + band 16", "LoLCATs"])
    closed = [(200 - 60) / (200 - 50), (210 - 61) / (210 - 50)]
    assert row[2] == "205.0 ± 7.1" and row[3] == "60.5 ± 0.7"
    assert row[4] == f"{100 * np.mean(closed):.1f} ± {100 * np.std(closed, ddof=1):.1f}"
    assert row[5] == "51.0 ± 1.4" and row[6] == "100 (2.00 %)" and row[7] == 300 * 16 * 128
    texts = dict(rep.comparisons)

    def z(a, b):          # lower is better: (b − a) / SE
        a, b = np.array(a), np.array(b)
        return (b.mean() - a.mean()) / np.sqrt(np.var(a, ddof=1) / 2 + np.var(b, ddof=1) / 2)

    band = next(t for t in texts if "band + linear beats linear alone" in t)
    assert f"(z = {z([60.0, 61.0], [80.0, 90.0]):.1f})" in band and texts[band] == "agrees"
    hh = next(t for t in texts if t.startswith("Hedgehog | LoLCATs") and "FAVOR+ | LoLCATs" in t)
    assert f"(z = {z([80.0, 90.0], [120.0, 130.0]):.1f})" in hh and texts[hh] == "agrees"
    sharp = next(t for t in texts if "FAVOR# inherits the most on day 0" in t)
    assert f"(z = {z([250.0, 260.0], [400.0, 420.0]):.1f})" in sharp and texts[sharp] == "agrees"
    task = next(t for t in texts if t.startswith("task check") and "perplexity" in t)
    assert "band 16 alone" in task and texts[task] == "agrees"            # 50 against 66–67
    # recall, higher is better: the source's one run against 70 % and 74 %, and against the best linear kind
    # without a band (FAVOR#: 55 %, 61 %)
    task = next(t for t in texts if "recall needs more than the band" in t)
    assert f"(z = {(90 - 72) / np.sqrt(np.var([70, 74], ddof=1) / 2):.1f})" in task and texts[task] == "agrees"
    zoo = next(t for t in texts if t.startswith("Zoology") and "FAVOR# | LoLCATs (58.0 ± 4.2 %)" in t)
    assert f"(z = {(90 - 58) / np.sqrt(np.var([55, 61], ddof=1) / 2):.1f})" in zoo and texts[zoo] == "agrees"
    most = next(t for t in texts if "closes most of the gap" in t)
    gap = np.array(closed)
    assert f"(z = {(gap.mean() - 0.5) / np.sqrt(np.var(gap, ddof=1) / 2):.1f})" in most
    assert "2.00 % of the parameters" in most
    assert any("source recalls 90.0 %" in n and "8 key-value pairs" in n for n in rep.notes)
    assert rep.checks[0][1]
    missing = lin._report({**p, "asked": p["asked"] + ["T2R | LoLCATs"]}, source, runs, recall)
    assert missing.checks[0][1] is False


def test_linearize_sweep_settings_are_valid_configs_named_as_asked(tmp_path):
    """Every setting of the default sweep is a config that validates (each override a key the config has,
    LoLCATs' recipe with transfer only where the kind has something to transfer) and carries the label the
    report asks for; the recipes give the same number of steps."""
    import argparse
    from favor import job, uptrain
    from favor.config import loading
    from favor import sweeps
    from favor.repro import linearize as lin
    from favor.tools.report import RunRecord

    args = argparse.Namespace(quick=False, seeds=None, kinds=None, band=None, recipes=None, source_steps=None,
                              transfer_steps=None, steps=None, parallel=2)
    p = lin.plan(args)
    runs = sweeps.load(p["sweep"])
    assert len(runs) == 2 * 2 * (6 * 2 + 1) and len(p["asked"]) == 26
    base = p["sweep"].split(":")[0]
    (tmp_path / "source" / "checkpoints").mkdir(parents=True)       # where a source run would be
    for r in runs:
        if r.overrides["seed"]:
            continue
        config = loading.load(base)
        loading.apply_flag(config, f"model.init_from=run:{tmp_path / 'source'}")
        for key, value in r.overrides.items():
            loading.apply_flag(config, f"{key}={value}")
        job.validate(config)
        assert config.total_steps == 300, r.overrides
        # a run's flags fix its recipe whatever get_config's own defaults are: full fine-tuning has no adapters
        assert uptrain.uses_lora(config.uptrain) == (r.overrides["uptrain.finetune"] == "lora"), r.overrides
        assert lin._label(RunRecord(r.name, None, overrides=dict(r.overrides))) in p["asked"]
    recipes = {lin._label(RunRecord(r.name, None, overrides=dict(r.overrides))): r.overrides for r in runs}
    assert recipes["Hedgehog + band 8 | LoLCATs"]["uptrain.trainable"] == "feature_maps"
    assert recipes["FAVOR+ | LoLCATs"]["uptrain.trainable"] == "lora"
    assert recipes["ELU + band 8 | LoLCATs"]["model.attention.window_mix"] == "learned"
    assert "model.attention.window_mix" not in recipes["FAVOR# + band 8 | LoLCATs"]
    assert recipes["band 8 alone | LoLCATs"]["uptrain.transfer_steps"] == 0


def test_linearize_recall_probe_scores_an_oracle_and_reads_the_eval_stream(tmp_path, monkeypatch):
    """probe_recall against models written here: one that answers every query with the value paired with its
    key in the context scores 1; the same answers one position late score (about) nothing; a run without
    MQAR mixed in is not probed; the figure is cached per checkpoint step."""
    import json
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from favor.repro import linearize as lin
    from favor.tools import generate

    pairs, vocab = 4, 64

    class Oracle(nnx.Module):
        def __init__(self, late=False):
            self.late = late

        def __call__(self, ids):
            keys, values = ids[:, 0:2 * pairs:2], ids[:, 1:2 * pairs:2]            # the context k1 v1 k2 v2 ...
            hit = ids[:, :, None] == keys[:, None, :]                              # [B, L, pairs]
            answer = jnp.sum(jnp.where(hit, values[:, None, :], 0), -1)
            if self.late:
                answer = jnp.roll(answer, 1, axis=1)
            return {"logits": 10.0 * jax.nn.one_hot(answer, vocab)}

    model = Oracle()
    monkeypatch.setattr(generate, "load", lambda workdir: (None, model, None))
    run = tmp_path / "run"
    (run / "checkpoints" / "5").mkdir(parents=True)
    block = {"name": "mqar", "vocab_size": vocab, "seq_len": 32, "num_pairs": pairs, "random_non_queries": False}
    (run / "config.json").write_text(json.dumps({"data": {"mix_in": block}}))
    assert lin.probe_recall(run) == 1.0
    model = Oracle(late=True)
    assert lin.probe_recall(run) == 1.0                 # cached for step 5
    (run / "checkpoints" / "10").mkdir()
    assert lin.probe_recall(run) < 0.05                 # a new checkpoint is probed again
    assert json.loads((run / "recall.json").read_text())["probe"]["step"] == 10
    (run / "config.json").write_text(json.dumps({"data": {}}))
    assert lin.probe_recall(run) is None
