"""The benchmark command runs and writes its table and JSON (figures themselves are not asserted)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor import attention
from favor.bench import cli, common, ratios, sections

ROOT = Path(__file__).resolve().parents[1]


def _committed_copy(tmp_path, monkeypatch, section):
    """A copy of the checkout's BENCHMARKS.md and committed bench/<section>.* made the working directory, and
    the temporary directories made under tmp_path: a run that wrote to the committed path would change the
    copy, and the real checkout is never at risk. Returns the copy's {path: sha256}."""
    copy = tmp_path / "checkout"
    (copy / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "BENCHMARKS.md", copy)
    for path in (ROOT / "bench").glob(f"{section}.*"):
        shutil.copy(path, copy / "bench")
    monkeypatch.chdir(copy)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return _hashes(copy)


def _hashes(folder):
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def _quick_out(said, tmp_path, what, section):
    """The directory a quick run without --out named on its last line, checked to be a fresh one of its own."""
    line = said.rstrip().splitlines()[-1]
    out = Path(line.split(" and ")[0].removeprefix("quick run: wrote ")).parent
    assert line == (f"quick run: wrote {out}/BENCHMARKS.md and {out}/bench/{section}.* (a smoke run; the "
                    "committed figures are untouched)"), line
    assert out.parent == tmp_path and out.name.startswith(f"favor-bench-{what}-quick-"), out
    return out


def test_bench_attention_writes_table_and_json(tmp_path):
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n\nkept text\n")
    # a variant and a window in one spec: the parsing both need
    cli.main(["attention", "--lengths", "64", "--kinds", "softmax,favor#:saderf@4",
                "--repeats", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench" / "attention.json").read_text())
    kinds = {(r["kind"], r["causal"]) for r in data["rows"]}
    assert kinds == {(k, c) for k in ("softmax", "favor#:saderf@4") for c in (False, True)}
    for r in data["rows"]:
        assert r["fwd"]["seconds"] > 0 and r["fwd_bwd"]["flops"] > 0
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "kept text" in md and "| 64 | causal | favor#:saderf@4 |" in md
    # a second run replaces its section instead of appending another (what every subcommand writes with)
    sections.replace_section(tmp_path, "attention-benchmark", "## attention-benchmark\n\nagain")
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert md.count("attention-benchmark:begin") == 1 and "again" in md and "kept text" in md
    assert "| 64 | causal | favor#:saderf@4 |" not in md


def test_flops_come_from_the_twin_only_when_it_is_another_program(monkeypatch):
    """The FLOP count is the twin's (one chunk, one span of the whole length): taken from the layer's own
    compile when the twin traces to the same program, compiled for the twin when it differs."""
    # causal FAVOR# at 32 tokens: one span either way, the same program; the count is the twin's own
    attn, twin, args, stats = common.setup("favor#:saderf", 32, True)
    assert twin is not attn
    expect = common.flops_of(twin, True, *args, stats, grad=False)
    own = common.compile_fn(common.layer_fn(attn, True, stats, False), args)[2]
    with monkeypatch.context() as m:
        m.setattr(common, "flops_of", lambda *a, **k: pytest.fail("the same program was compiled again"))
        assert common.counted_flops(attn, twin, True, args, stats, False, own) == expect > 0
    # bidirectional FAVOR+ at 32 tokens: its own chunking and the twin's one chunk are two programs
    attn, twin, args, stats = common.setup("favor+", 32, False)
    asked = []
    monkeypatch.setattr(common, "flops_of", lambda a, *rest, **k: asked.append(a) or 7.0)
    assert common.counted_flops(attn, twin, False, args, stats, False, -1.0) == 7.0 and asked == [twin]


def test_bench_train_records_the_metric_against_time(tmp_path):
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    argv = ["train", "--config", "configs/default.py:runlocal", "--metric", "accuracy", "--target", "0.0",
            "--higher_is_better", "--out", str(tmp_path), "--section", "digits",
            "--", "--config.total_steps=4", "--config.eval_every=2", "--config.checkpoint_every=4"]
    cli.main(argv)
    data = json.loads((tmp_path / "bench" / "digits.json").read_text())
    assert [e["step"] for e in data["evals"]] == [2, 4]
    assert data["evals"][0]["seconds"] < data["evals"][1]["seconds"] < data["meta"]["process_seconds"]
    assert data["meta"]["seconds_to_target"] == data["evals"][0]["seconds"]     # any accuracy > 0
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "accuracy > 0.0 first at step 2" in md and "| 4 |" in md


def test_bench_parts_writes_every_part_against_one_yardstick(tmp_path):
    cli.main(["parts", "--length", "128", "--repeats", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench" / "favor-plus-parts.json").read_text())
    ratios = {r["part"]: r["ratio"] for r in data["rows"]}
    assert len(ratios) == 7 and all(r > 0 for r in ratios.values())
    floor = ratios["sum of the parts with perfect fusion (matmuls + in-place exp)"]
    parts = [r for name, r in ratios.items() if name.startswith(("2 projections", "[V,1]", "Φ_q", "2 exp over [B, H, L, M], consumed"))]
    assert abs(floor - sum(parts)) < 1e-9 * max(1.0, floor)
    assert "| FAVOR+ forward (the library) |" in (tmp_path / "BENCHMARKS.md").read_text()


def test_bench_ratios_times_round_robin_and_writes_the_verdicts(tmp_path):
    targets = "favor+/causal,favor+/bidir,1.5;favor+/bidir,matmul:favor+/bidir,2;favor+@4/causal,favor+/causal,1.25"
    cli.main(["ratios", "--length", "32", "--rounds", "3", "--out", str(tmp_path), "--targets", targets])
    data = json.loads((tmp_path / "bench" / "attention-ratios.json").read_text())
    assert [(r["numerator"], r["denominator"], r["target"]) for r in data["rows"]] == [
        ("favor+/causal", "favor+/bidir", 1.5), ("favor+/bidir", "matmul:favor+/bidir", 2.0),
        ("favor+@4/causal", "favor+/causal", 1.25)]
    times = data["times"]
    assert set(times) == {"favor+/causal", "favor+/bidir", "matmul:favor+/bidir", "favor+@4/causal"}
    for r in data["rows"]:
        assert abs(r["ratio_of_minima"] - times[r["numerator"]]["min_ms"] / times[r["denominator"]]["min_ms"]) < 1e-9
        assert r["rounds_within_target"] in (0, 1 / 3, 2 / 3, 1)
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| favor+/causal : favor+/bidir | ≤ 1.5 |" in md
    with pytest.raises(SystemExit):
        cli.main(["ratios", "--targets", "favor+/sideways,favor+/bidir,1"])


def test_bench_ratios_times_forward_and_backward(tmp_path):
    """'+grad' entries time the forward and backward pass; a matmul yardstick of one takes its FLOPs."""
    targets = "favor++/bidir+grad,favor+/bidir+grad,1.15;favor+/bidir+grad,matmul:favor+/bidir+grad,3"
    cli.main(["ratios", "--length", "32", "--rounds", "2", "--out", str(tmp_path), "--targets", targets])
    data = json.loads((tmp_path / "bench" / "attention-ratios.json").read_text())
    assert set(data["times"]) == {"favor++/bidir+grad", "favor+/bidir+grad", "matmul:favor+/bidir+grad"}
    fwd, _, flops_fwd = ratios._forward("favor+", 32, False)
    _, _, flops_grad = ratios._forward("favor+", 32, False, grad=True)
    assert flops_grad > 1.5 * flops_fwd
    assert "| favor++/bidir+grad : favor+/bidir+grad | ≤ 1.15 |" in (tmp_path / "BENCHMARKS.md").read_text()
    assert ratios.TARGET_SETS["kinds"] == ratios.KIND_TARGETS


def test_bench_steps_times_every_kinds_training_step(tmp_path):
    """The config's real training step per kind, round-robin; ratios to FAVOR+'s per round; flags after
    -- apply to every kind."""
    cli.main(["steps", "--config", "configs/default.py:runlocal", "--kinds", "softmax,favor+,favor", "--rounds",
                "3", "--out", str(tmp_path), "--", "--config.model.attention.num_features=8"])
    data = json.loads((tmp_path / "bench" / "train-steps.json").read_text())
    rows = {r["kind"]: r for r in data["rows"]}
    assert set(rows) == {"softmax", "favor+", "favor"} and all(len(t) == 3 for t in data["times"].values())
    assert rows["favor+"]["ratio"] == 1.0 and rows["favor"]["ratio"] > 0
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| favor |" in md and "time / favor+'s" in md
    with pytest.raises(SystemExit):
        cli.main(["steps", "--kinds", "performer"])


# The torch side runs in a process of its own, as every torch use in the suite does (tests/hf_reference.py
# says why): both programs of the harness compared on the same inputs (printed as JSON), then the command
PEERS_ERRORS = """
import json, sys
import numpy as np
from favor.bench import peers
q, k, v = peers.inputs(64)
logits = np.einsum("blhd,bmhd->bhlm", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
out = {}
for causal in (False, True):
    w = np.exp(logits - logits.max(-1, keepdims=True))
    if causal:
        w = np.tril(w)
    exact = np.einsum("bhlm,bmhd->bhld", w / w.sum(-1, keepdims=True), v.astype(np.float64))
    favor_fwd, _ = peers.favor_programs(64, causal, (q, k, v))
    peer_fwd, _ = peers.peer_programs(64, causal, (q, k, v))
    out[str(causal)] = [float(np.linalg.norm(o - exact) / np.linalg.norm(exact))
                        for o in (np.moveaxis(np.asarray(favor_fwd()), 1, 2), peer_fwd().numpy())]
print("ERRORS", json.dumps(out))
from favor.bench import cli
cli.main(["peers", "--lengths", "32", "--rounds", "2", "--out", sys.argv[1]])
"""


def _python(*args, cwd=None):
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_bench_peers_times_favor_against_performer_pytorch(tmp_path):
    """Both sides of the harness compute the same attention (each close to exact softmax on the shared
    inputs, so the comparison is like for like), every program is timed every round, and the table and
    JSON are written; bad arguments are one parser error."""
    # one process for both parts: importing torch and jax is most of its time
    out = _python("-c", PEERS_ERRORS, str(tmp_path))
    errors = json.loads(out.split("ERRORS", 1)[1].splitlines()[0])
    # M = 256 FAVOR+ estimates on both sides: errors of one size (0.24 causal, 0.35 bidirectional,
    # where the near-uniform weights leave a small output), while the causal mean of all values is 0.9 off
    for mode, pair in errors.items():
        assert max(pair) < 0.5 and max(pair) < 2 * min(pair), (mode, pair)
    data = json.loads((tmp_path / "bench" / "peers.json").read_text())
    assert len(data["rows"]) == 2 * 2 and all(len(t) == 2 for t in data["times"].values())
    assert all(r["favor_ms"] > 0 and r["peer_ms"] > 0 for r in data["rows"])
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| 32 | causal |" in md and "performer-pytorch" in md
    for argv in (["peers", "--modes", "sideways"], ["peers", "--lengths", "0"], ["peers", "--lengths", "x"]):
        with pytest.raises(SystemExit):
            cli.main(argv)


def test_bench_uptrain_gives_a_kind_its_own_variant_option():
    """`--kinds hrf:gaussian` runs HRF-gaussian: the variant sets the option the kind takes (lambda_ for
    HRF, features for SimRF, variant for FAVOR#), which the run's attention then receives."""
    from favor.bench import uptrain as bench_uptrain
    for spec, key, value in (("hrf:gaussian", "lambda_", "gaussian"), ("simrf:oprf", "features", "oprf"),
                             ("favor#:saderf", "variant", "saderf")):
        config = bench_uptrain._config("configs/default.py", [], spec)
        options = attention.block_options(config.model.attention)
        assert options["kind"] == spec.partition(":")[0] and options[key] == value, options
        assert key not in attention.ignored_block_options(config.model.attention)


def test_bench_generate_writes_speed_and_state_against_softmax(tmp_path):
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    cli.main(["generate", "--lengths", "8,24", "--kinds", "softmax,favor+", "--tokens", "3", "--rounds", "1",
              "--preset", "tiny", "--num_features", "16", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench" / "generate.json").read_text())["results"]
    # FAVOR+'s state is the same at both prompt lengths; softmax's cache holds prompt + tokens positions
    assert data["8"]["favor+"]["state_bytes"] == data["24"]["favor+"]["state_bytes"]
    assert data["24"]["softmax"]["state_bytes"] == data["8"]["softmax"]["state_bytes"] * 27 // 11
    assert all(v["tokens_per_s"] > 0 and v["prefill_s"] > 0 for r in data.values() for v in r.values())
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| 24 | favor+ |" in md and "![generation](bench/generate.png)" in md
    assert (tmp_path / "bench" / "generate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        cli.main(["generate", "--preset", "huge"])


def test_bench_accel_checks_times_and_writes(tmp_path, monkeypatch):
    """Every kind on XLA and, where it has one, on the fused kernel, against softmax; the device check of
    the kernel; the crossover table, the decoder step and the plot (figures not asserted)."""
    from favor.bench import accel
    monkeypatch.setattr(accel, "DECODER", dict(hidden=32, heads=2, num_layers=1, mlp_dim=64))
    cli.main(["accel", "--check", "--check-length", "80", "--kinds", "favor+,relu", "--lengths", "64",
              "--modes", "causal,bidir", "--passes", "fwd,grad", "--dtypes", "float32", "--head-dims", "64",
              "--tokens", "64", "--rounds", "2", "--decoder-lengths", "32", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench" / "accel-cpu.json").read_text())
    assert len(data["rows"]) == 4                        # causal/bidir × fwd/grad at one length
    for r in data["rows"]:
        assert set(r["results"]) == {"softmax", "favor+/xla", "favor+/pallas", "relu/xla"}
        assert all(v["median_ms"] > 0 for v in r["results"].values())
    assert [(c["kind"], c["causal"]) for c in data["checks"]] == [("favor+/pallas", False), ("favor+/pallas", True)]
    assert all(c["out"] < 1e-5 and c["grad"] < 1e-5 for c in data["checks"])
    assert data["checks"][1]["causal_bitwise"]
    assert set(data["decoder"][0]["results"]) == {"softmax", "favor+/xla", "favor+/pallas"}
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## accel-cpu" in md and "| float32 | 64 | causal+grad | 64 | 1 |" in md and "tok/s" in md
    png = tmp_path / "bench" / "accel-cpu.png"
    assert png.stat().st_size > 0
    png.unlink()
    cli.main(["accel", "--replot", str(tmp_path / "bench" / "accel-cpu.json")])
    assert png.stat().st_size > 0
    with pytest.raises(SystemExit):
        cli.main(["accel", "--kernel-precisions", "fp8"])
    assert not data["meta"]["quick"] and sections.SMOKE not in md


def test_bench_accel_quick_leaves_the_committed_figures_alone(tmp_path, monkeypatch, capsys):
    """`accel --quick` without --out, from a copy of the committed section and figures: it writes a fresh
    temporary directory it names, marked as a smoke run, and the committed files stay byte for byte
    (the budget spent at once: the grid listed as not run; the decoder step of softmax alone, on a small
    decoder)."""
    from favor.bench import accel
    monkeypatch.setattr(accel, "DECODER", dict(hidden=32, heads=2, num_layers=1, mlp_dim=64))
    before = _committed_copy(tmp_path, monkeypatch, "accel-cpu")
    cli.main(["accel", "--quick", "--budget", "0", "--decoder-kinds", "softmax"])
    assert _hashes(tmp_path / "checkout") == before
    out = _quick_out(capsys.readouterr().out, tmp_path, "accel", "accel-cpu")
    data = json.loads((out / "bench" / "accel-cpu.json").read_text())
    assert data["meta"]["quick"] and all("budget" in r["note"] for r in data["rows"]) and data["decoder"]
    section = (out / "BENCHMARKS.md").read_text().split("<!-- accel-cpu:begin -->")[1].strip().splitlines()
    assert section[0].endswith("python -m favor.bench accel --quick --budget 0 --decoder-kinds softmax`)")
    assert section[2] == sections.SMOKE


def test_bench_tune_times_each_cut_against_the_tuning_table_and_leaves_it_alone(tmp_path, monkeypatch, capsys):
    """Every mode and precision asked for: the cut TUNING holds and each candidate, timed (interpret mode
    here: figures not asserted beyond being positive), ratios to TUNING's cut (1 for itself); the table
    is left as it was; a malformed cut is the parser's error naming it."""
    from favor.attention import fused
    from favor.bench import tune
    before = dict(fused.TUNING)
    cli.main(["tune", "--quick", "--precisions", "tf32x3,highest", "--out", str(tmp_path)])
    assert fused.TUNING == before
    rows = json.loads((tmp_path / "bench" / "tune-cpu.json").read_text())["rows"]
    assert [(r["causal"], r["precision"]) for r in rows] == [(True, "tf32x3"), (True, "highest"),
                                                             (False, "tf32x3"), (False, "highest")]
    for r in rows:
        assert r["tuning"] == tune._name(fused.tuning(r["causal"], r["precision"]))
        assert set(r["results"]) == {r["tuning"], "16x32x4x1"}
        assert all(v["median_ms"] > 0 for v in r["results"].values())
        assert r["results"][r["tuning"]]["ratio"] == 1.0
    data = json.loads((tmp_path / "bench" / "tune-cpu.json").read_text())
    assert data["meta"]["quick"] and "## tune-cpu" in (tmp_path / "BENCHMARKS.md").read_text()
    assert sections.SMOKE in (tmp_path / "BENCHMARKS.md").read_text()
    # each candidate is the program of its own cut (attend's `cut`): TUNING's cut lowers as a plain call
    # does, another differs
    inputs = tune._inputs(64, 1, 2, 16, 32)
    text = lambda cut: tune._lowered(True, "tf32x3", cut, inputs).as_text()
    def loss(xq, rq, xk, rk, v, p, c):                     # named as tune's, so the module names match
        return jnp.sum(fused.attend(xq, rq, p, c, xk, rk, p, c, v, None, True, precision="tf32x3")[0])
    plain = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4))).lower(*inputs).as_text()
    assert text(fused.tuning(True, "tf32x3")) == plain != text((16, 16, 4, 1))
    assert fused.TUNING == before
    assert tune.parse_cut("32x64x4x2") == (32, 64, 4, 2)
    for bad in ("32x64x4", "24x64x4x1", "32x64x3x1", "32xbx4x1"):
        with pytest.raises(ValueError, match="chunk x block x warps x stages"):
            tune.parse_cut(bad)
    with pytest.raises(SystemExit):
        cli.main(["tune", "--cuts", "64x64", "--out", str(tmp_path)])
    # a spent budget: every configuration listed as not run (nothing compiled), the table still whole; run
    # without --out from a copy of the committed figures, which it leaves byte for byte, writing a fresh
    # temporary directory it names instead
    before = _committed_copy(tmp_path / "spent", monkeypatch, "tune-cpu")
    capsys.readouterr()
    cli.main(["tune", "--quick", "--budget", "0"])
    assert _hashes(tmp_path / "spent" / "checkout") == before
    out = _quick_out(capsys.readouterr().out, tmp_path / "spent", "tune", "tune-cpu")
    rows = json.loads((out / "bench" / "tune-cpu.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["results"] == {} and "budget" in r["note"] for r in rows)
    section = (out / "BENCHMARKS.md").read_text().split("## tune-cpu")[1]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert len(table) == 6 and len({line.count("|") for line in table}) == 1, table


def test_the_accelerator_script_runs_the_parts_asked_for_each_with_its_budget(tmp_path):
    """launch/bench_accel.sh with a stand-in interpreter that records its arguments: the three parts in order
    by default, one part alone when named (what a short device loan runs), each with its budget; an unknown
    part is refused before anything runs."""
    script = Path(__file__).resolve().parents[1] / "launch" / "bench_accel.sh"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s " "$@" >> {tmp_path}/calls\necho >> {tmp_path}/calls\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "BUDGET_KINDS": "420"}

    def run(*parts):
        (tmp_path / "calls").unlink(missing_ok=True)
        done = subprocess.run(["bash", str(script), str(tmp_path / "out"), *parts], env=env, capture_output=True,
                              text=True, timeout=60)
        calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
        return done, calls

    done, calls = run()
    assert done.returncode == 0, done.stderr
    assert [c.split()[2] for c in calls] == ["tune", "accel", "accel"] and "--check" in calls[1]
    assert all(f"--out {tmp_path / 'out'}" in c for c in calls)
    done, calls = run("kinds")
    assert len(calls) == 1 and "--decoder-lengths" in calls[0] and "--budget 420 " in calls[0]
    done, calls = run("tune", "kinds")
    assert [c.split()[2] for c in calls] == ["tune", "accel"] and "--budget 600 " in calls[0]
    done, calls = run("grid", "decoder")
    assert done.returncode == 2 and "unknown part 'decoder'; valid: tune, grid, kinds" in done.stderr and not calls


def test_bench_lora_counts_optimizer_memory_from_shapes(tmp_path):
    """The tiny decoder (2 layers, hidden 64): LoRA at rank 2 trains 2 × 4 × 2 · (64 + 64) parameters and
    holds AdamW's two float32 moments for them alone (plus its scalar step counts); full fine-tuning
    holds them for every parameter."""
    cli.main(["lora", "--presets", "tiny", "--ranks", "2", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "bench" / "lora-memory.json").read_text())["rows"][0]
    from favor import models
    cfg = models.config("decoder", "tiny")
    assert (cfg["num_layers"], cfg["hidden"]) == (2, 64)
    trained = 2 * 4 * 2 * (64 + 64)
    assert row["lora"]["2"]["trainable"] == trained
    assert 8 * trained <= row["lora"]["2"]["optimizer_bytes"] <= 8 * trained + 64
    assert 8 * row["params"] <= row["full"] <= 8 * row["params"] + 64
    assert "| tiny |" in (tmp_path / "BENCHMARKS.md").read_text()


def test_the_headline_is_generated_from_the_sections_raw_figures(tmp_path):
    """Publishing a section rewrites the headline at the top from bench/*.json: each section with targets
    in the file's order, its machine, how many targets it met (median ratio ≤ target) and the ones it missed;
    a section without targets is not listed; the headline command alone gives the same text."""
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n\nintro\n\n## a hand-written part\n\nkept\n")
    meta = {"jax": "0.10.2", "backend": "cpu", "cpu_count": 2}
    rows = [{"numerator": "favor+/causal", "denominator": "favor+/bidir", "target": 1.3, "median_ratio": 1.77,
             "ratio_of_minima": 1.5, "rounds_within_target": 0.1},
            {"numerator": "favor#/bidir", "denominator": "favor+/bidir", "target": 1.4, "median_ratio": 1.4,
             "ratio_of_minima": 1.3, "rounds_within_target": 0.5}]
    sections.publish(tmp_path, "r1", "## r1\n\nbody", {"meta": meta, "rows": rows})
    sections.publish(tmp_path, "plain", "## plain\n\nno targets", {"meta": meta, "rows": [{"kind": "x"}]})
    sections.publish(tmp_path, "speech", "## speech", {"meta": {**meta, "target": 0.5, "metric": "wer",
                                                               "seconds_to_target": 181.6}, "evals": [{"wer": 0.4}]})
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert md.index("intro") < md.index("<!-- headline:begin -->") < md.index("## a hand-written part")
    assert md.count("headline:begin") == 1
    head = md[md.index("<!-- headline:begin -->"):md.index("<!-- headline:end -->")]
    assert "| [r1](#r1) | cpu (2 cores), jax 0.10.2 | 1 of 2 | favor+/causal : favor+/bidir 1.77 (≤ 1.3) |" in head
    assert "| [speech](#speech) | cpu (2 cores), jax 0.10.2 | wer < 0.5 first 182 s after the start | – |" in head
    assert "plain" not in head and head.index("[r1]") < head.index("[speech]")
    # a rerun of a section with new figures changes its row
    rows[0]["median_ratio"] = 1.2
    sections.publish(tmp_path, "r1", "## r1\n\nbody", {"meta": meta, "rows": rows})
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| [r1](#r1) | cpu (2 cores), jax 0.10.2 | 2 of 2 | – |" in md and md.count("headline:begin") == 1
    assert cli.main(["headline", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "BENCHMARKS.md").read_text() == md


def test_bench_ratios_times_packed_documents(tmp_path):
    """'+docs' entries run the layer over packed rows (segment ids of common.DOCUMENTS documents a row; a
    data-dependent kind on statistics in either mode): the documents target set names each kind's packed
    pass against its unpacked one, and a matmul of documents is refused."""
    from favor.bench import common
    seg = np.asarray(common.packed_segments(64))
    assert seg.shape == (common.B, 64) and np.all(np.diff(seg, axis=1) >= 0)
    assert [len(np.unique(row)) for row in seg] == [common.DOCUMENTS] * common.B
    targets = "favor#/bidir+docs,favor#/bidir,3;favor+/causal+docs+grad,favor+/causal+grad,1.5"
    cli.main(["ratios", "--length", "64", "--rounds", "2", "--out", str(tmp_path), "--targets", targets])
    data = json.loads((tmp_path / "bench" / "attention-ratios.json").read_text())
    assert set(data["times"]) == {"favor#/bidir+docs", "favor#/bidir", "favor+/causal+docs+grad", "favor+/causal+grad"}
    assert all(r["ratio_of_minima"] > 0 for r in data["rows"])
    assert ("favor+/causal+docs", "favor+/causal", 1.5) in ratios.TARGET_SETS["documents"]
    with pytest.raises(ValueError, match="a matmul has no documents"):
        ratios._entry("matmul:favor+/causal+docs")
