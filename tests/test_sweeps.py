"""Sweeps end in a comparison: sweep products and names, the local launcher (parallel, skip finished,
failures listed), and favor.tools.report's table, seed statistics and plot."""

import ast
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from favor import attention
from favor import sweeps
from favor.train import events
from favor.tools import report

ROOT = Path(__file__).resolve().parents[1]


# -- favor.sweeps -------------------------------------------------------------------------------------
def test_product_is_every_combination_first_axis_slowest():
    items = list(sweeps.product({"model.attention.kind": ("a", "b", "c"), "model.attention.num_features": (16, 64),
                                 "seed": (0, 1)}))
    assert len(items) == 12 and len({json.dumps(i, sort_keys=True) for i in items}) == 12
    assert items[0] == {"model.attention.kind": "a", "model.attention.num_features": 16, "seed": 0}
    assert items[1]["seed"] == 1 and items[2]["model.attention.num_features"] == 64 and items[4]["model.attention.kind"] == "b"
    for bad in ("softmax", (), 3):
        with pytest.raises(ValueError, match="kind"):
            list(sweeps.product({"kind": bad}))


def test_run_names_are_distinct_and_safe():
    runs = sweeps.runs([{"model.attention.kind": "favor#", "seed": 0}, {"model.attention.kind": "favor#", "seed": 1},
                        {"model.dropout": 0.1, "optim.dropout": 0.2}])
    assert [r.name for r in runs] == ["kind=favor#_seed=0", "kind=favor#_seed=1",
                                      "model.dropout=0.1_optim.dropout=0.2"]    # a shared last part: whole key
    assert runs[1].flags() == ["--config.model.attention.kind=favor#", "--config.seed=1"]
    assert sweeps.run_name({"data.path": "a/b c"}) == "path=a-b-c"
    with pytest.raises(ValueError, match="items 0 and 1 are the same run"):
        sweeps.runs([{"seed": 0}, {"seed": 0}])
    with pytest.raises(ValueError, match="sweep item 1"):
        sweeps.runs([{"seed": 0}, ["seed", 1]])
    assert sweeps.is_seed_key("seed") and sweeps.is_seed_key("data.seed") and not sweeps.is_seed_key("split_seed")


def test_default_config_sweeps_kinds_times_seeds():
    runs = sweeps.load(str(ROOT / "configs/default.py") + ":seeds=3")
    from configs import default
    assert len(runs) == 3 * len(attention.names())       # every kind by default
    assert [r.overrides["seed"] for r in runs[:4]] == [0, 1, 2, 0]
    assert runs[0].name == "kind=softmax_seed=0"
    with pytest.raises(ValueError, match="unknown arg 'seedz'"):
        sweeps.load(str(ROOT / "configs/default.py") + ":seedz=3")
    default.get_config("seeds=3")          # the config itself accepts (and ignores) the sweep's arg


def test_seed_by_seed_runs_every_setting_before_any_twice():
    items = list(sweeps.seed_by_seed([{"a": 1}, {"a": 2, "b": "x"}], range(2)))
    assert items == [{"a": 1, "seed": 0}, {"a": 2, "b": "x", "seed": 0}, {"a": 1, "seed": 1},
                     {"a": 2, "b": "x", "seed": 1}]
    assert [r.name for r in sweeps.runs(items)] == ["a=1_seed=0", "a=2_b=x_seed=0", "a=1_seed=1", "a=2_b=x_seed=1"]


def test_sweep_lists_keep_kind_names_with_plus_signs():
    """"+" is part of kind names: a list arg separates by "/", and favor+ / favor++ stay themselves."""
    runs = sweeps.load(str(ROOT / "configs/default.py") + ":seeds=1,kinds=favor+/favor++/favor,qk_norms=none/l2")
    assert [(r.overrides["model.attention.kind"], r.overrides["model.attention.qk_norm"]) for r in runs] == \
        [("favor+", ""), ("favor+", "l2"), ("favor++", ""), ("favor++", "l2"), ("favor", ""), ("favor", "l2")]
    with pytest.raises(ValueError, match=r"kinds: unknown attention kind 'favor\+\+\+' in 'favor\+\+\+'; valid: softmax, "):
        sweeps.load(str(ROOT / "configs/default.py") + ":kinds=favor+++")
    runs = sweeps.load(str(ROOT / "configs/listops.py") + ":seeds=2,kinds=softmax/favor+,band=16")
    assert [r.name for r in runs] == [
        "kind=softmax_seed=0", "kind=favor+_seed=0", "kind=favor++_window=16_seed=0", "num_layers=0_pool=mean_seed=0",
        "kind=softmax_seed=1", "kind=favor+_seed=1", "kind=favor++_window=16_seed=1", "num_layers=0_pool=mean_seed=1"]


def test_kind_specs_in_a_sweep_set_the_kinds_option_and_each_run_is_a_valid_config():
    """A sweep's kinds are kind specs (kind[:variant][@window]): 'favor#:saderf' is FAVOR# with its variant set,
    and every run of the sweeps that take specs (the digits ViT, the GLUE fine-tuning, the BERT pretraining)
    applies to its config and validates as train.py would, with the variant reaching the attention layer's
    options; FAVOR# without a variant keeps its own (SDERF)."""
    from favor import attention, job
    from favor.config import loading
    spec = str(ROOT / "configs/default.py") + ":seeds=1,kinds=favor+/favor#:saderf/favor#/hrf:gaussian/favor+@8"
    assert [r.overrides for r in sweeps.load(spec)] == [
        {"model.attention.kind": "favor+", "seed": 0},
        {"model.attention.kind": "favor#", "model.attention.variant": "saderf", "seed": 0},
        {"model.attention.kind": "favor#", "seed": 0},
        {"model.attention.kind": "hrf", "model.attention.lambda_": "gaussian", "seed": 0},
        {"model.attention.kind": "favor+", "model.attention.window": 8, "seed": 0}]
    # GLUE needs a tokenizer: the config's (vocab=) or the source model's (init_from, as the sweep's docstring runs it)
    glue_spec = str(ROOT / "configs/bert_glue.py") + ":task=docorder,local,steps=300,seeds=2,vocab=vocab.txt"
    for config_spec in (spec, glue_spec,
                        str(ROOT / "configs/bert_pretrain.py") + ":data=local,seeds=1,kinds=softmax/favor#:saderf"):
        options = []
        for run in sweeps.load(config_spec):
            config = loading.load(config_spec)
            for key, value in run.overrides.items():
                loading.apply_flag(config, f"{key}={value}")
            job.validate(config)
            options.append(attention.block_options(config.model.attention))
        kinds = [(o["kind"], o.get("variant")) for o in options]
        assert ("favor#", "saderf") in kinds, (config_spec, kinds)
    assert {(o["kind"], o.get("variant"), o.get("lambda_")) for o in options} == {("softmax", None, None),
                                                                              ("favor#", "saderf", None)}
    glue = sweeps.load(str(ROOT / "configs/bert_glue.py") + ":task=docorder,local,seeds=2")
    assert len(glue) == 2 * 7 and [r.overrides["seed"] for r in glue] == [0] * 7 + [1] * 7
    assert loading.load(str(ROOT / "configs/bert_glue.py") + ":task=docorder,local,steps=300").eval_every == 60
    for bad, match in (("kinds=favor#:nope", r"kinds: .*variant.*'nope'"), ("kinds=favor+:x", r"kinds: 'favor\+' has no variant"),
                       ("kinds=", "kinds: an empty list"), ("kinds=fav", r"kinds: unknown attention kind 'fav'")):
        with pytest.raises(ValueError, match=match):
            sweeps.load(str(ROOT / "configs/bert_glue.py") + ":task=docorder," + bad)
    with pytest.raises(ValueError, match="steps=-5: expected a positive"):
        loading.load(str(ROOT / "configs/bert_glue.py") + ":task=docorder,local,steps=-5")
    with pytest.raises(ValueError, match="runlocal and local"):
        loading.load(str(ROOT / "configs/bert_glue.py") + ":task=docorder,local,runlocal")


# -- launch/sweep_local.py on real runs -----------------------------------------------------------------
SWEEP_CONFIG = """
import os, sys
sys.path.insert(0, {root!r})
from configs import default
from favor import sweeps
from favor.train import events

def get_config(arg=None):
    c = default.get_config("runlocal")
    c.total_steps = int(os.environ.get("SWEEP_TEST_STEPS", 48))     # the test's first pass runs "forever"
    c.eval_every, c.checkpoint_every, c.log_every = 24, 4, 4
    return c

def sweep():
    yield from sweeps.product({{"model.attention.kind": ("softmax",), "seed": (0, 1)}})
    yield {{"model.attention.kind": "no-such-kind", "seed": 0}}      # fails at config validation
"""


def sweep_cmd(config, workdir, *flags):
    return [sys.executable, str(ROOT / "launch/sweep_local.py"), "--config", str(config), "--workdir", str(workdir),
            *flags]


def test_sweep_runs_in_parallel_skips_finished_lists_failures_and_reports(tmp_path):
    config = tmp_path / "sweep_config.py"
    config.write_text(SWEEP_CONFIG.format(root=str(ROOT)))
    sweep_dir = tmp_path / "sweep"
    assert subprocess.run(sweep_cmd(config, sweep_dir, "--count"), capture_output=True, text=True,
                          check=True).stdout.strip() == "3"
    # one run alone first (a SLURM array task does this), stopped by SIGTERM after its first checkpoint:
    # the launcher passes it on, the run checkpoints, and its status says stopped, not finished
    first = subprocess.Popen(sweep_cmd(config, sweep_dir, "--only", "0"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "SWEEP_TEST_STEPS": "100000"})
    names = ["kind=softmax_seed=0", "kind=softmax_seed=1", "kind=no-such-kind_seed=0"]
    checkpoints = sweep_dir / names[0] / "checkpoints"
    deadline = time.time() + 300
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 143 and f"0 {names[0]}" in err and "rerun the same command to resume" in err, err
    assert [r["name"] for r in json.loads((sweep_dir / "sweep.json").read_text())["runs"]] == names
    assert json.loads((sweep_dir / names[0] / "sweep_status.json").read_text())["status"] == "stopped"
    stopped = json.loads((sweep_dir / names[0] / "summary.json").read_text())
    assert stopped["preempted"] and 4 <= stopped["step"] < 48, stopped["step"]
    assert not (sweep_dir / names[1]).exists()
    # the whole sweep, two at a time: run 0 resumes from its checkpoint and runs to the end
    both = subprocess.run(sweep_cmd(config, sweep_dir, "--parallel", "2"), capture_output=True, text=True)
    assert both.returncode == 1, both.stdout + both.stderr[-3000:]
    assert "resumed from step" in (sweep_dir / names[0] / "train.log").read_text()
    resumed = json.loads((sweep_dir / names[0] / "summary.json").read_text())
    assert resumed["step"] == 48 and not resumed["preempted"]
    assert resumed["wall_seconds"] > stopped["wall_seconds"]      # the clock went on from the checkpoint's
    # rerun: the finished runs are skipped, the failed one is tried again
    again = subprocess.run(sweep_cmd(config, sweep_dir, "--parallel", "2"), capture_output=True, text=True)
    assert again.returncode == 1 and f"run 0 {names[0]} finished already; skipped" in again.stdout
    assert f"run 1 {names[1]} finished already; skipped" in again.stdout
    assert "failed runs:" in both.stderr and f"2 {names[2]}: exit code" in both.stderr
    assert "no-such-kind" in (sweep_dir / names[2] / "train.log").read_text()   # its own log, with the error
    status = {n: json.loads((sweep_dir / n / "sweep_status.json").read_text()) for n in names}
    assert [status[n]["status"] for n in names] == ["finished", "finished", "failed"]
    assert status[names[1]]["parallel"] == 2

    # what train.py leaves for the report: the resolved config, and the run's size and time
    run1 = sweep_dir / names[1]
    assert json.loads((run1 / "config.json").read_text())["seed"] == 1
    summary = json.loads((run1 / "summary.json").read_text())
    import orbax.checkpoint as ocp
    restored = ocp.StandardCheckpointer().restore(run1 / "checkpoints" / "48" / "state")
    assert summary["num_params"] == sum(np.asarray(x).size for x in __import__("jax").tree.leaves(restored["params"]))
    assert summary["wall_seconds"] > 0

    out = subprocess.run([sys.executable, "-m", "favor.tools.report", str(sweep_dir), "--plot", str(tmp_path / "r.png"),
                          "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["metric"] == "accuracy" and rep["keys"] == ["model.attention.kind", "seed"]
    rows = {r["name"]: r for r in rep["rows"]}
    assert rows[names[2]]["status"].startswith("failed (exit ") and rows[names[2]]["final"] is None
    assert rep["rows"][-1]["name"] == names[2]                      # no metric: listed last, not dropped
    for n in names[:2]:
        assert rows[n]["status"] == "finished" and rows[n]["final"] == json.loads(
            (sweep_dir / n / "summary.json").read_text())["accuracy"]
        assert rows[n]["num_params"] == summary["num_params"] and rows[n]["best_step"] in (24, 48)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert "| kind=softmax_seed=1 |" in out.stdout
    assert f"- {names[2]}: error: config.model.attention.kind='no-such-kind': must be one of" in out.stdout


# -- favor.tools.report on runs the test writes ----------------------------------------------------------------
def fake_run(path: Path, *, kind, seed, accuracy, steps=(10, 20), total=20, finished=True, status=None,
             qk_norm=None):
    """A run directory as train.py leaves it: config.json, TensorBoard eval scalars and (when finished)
    summary.json; `accuracy` is the eval curve, one value per step in `steps`."""
    path.mkdir(parents=True)
    block = {"kind": kind, "num_features": 64, **({} if qk_norm is None else {"qk_norm": qk_norm})}
    (path / "config.json").write_text(json.dumps({"seed": seed, "total_steps": total, "optim": {"lr": 0.01},
                                                  "model": {"attention": block}}))
    writer = events.ScalarWriter(path / "tensorboard")
    for i, (step, acc) in enumerate(zip(steps, accuracy)):
        writer.write_scalars(step, {"eval/accuracy": acc, "eval/loss": 1.0 - acc, "time/wall_seconds": 5.0 * (i + 1),
                                    "loss": 2.0 - acc})
    writer.close()
    if finished:
        (path / "summary.json").write_text(json.dumps({
            "step": total, "accuracy": accuracy[-1], "loss": 1.0 - accuracy[-1], "train_loss": 2.0 - accuracy[-1], "steps_per_second": 10.0 + seed,
            "preempted": False, "num_params": 1234, "wall_seconds": 5.0 * len(steps)}))
    if status:
        (path / "sweep_status.json").write_text(json.dumps(status))


def test_report_table_seed_means_and_unfinished_runs(tmp_path):
    acc = {("favor#", 0): [0.80, 0.91], ("favor#", 1): [0.85, 0.89], ("favor#", 2): [0.90, 0.96],
           ("relu", 0): [0.70, 0.75], ("relu", 1): [0.72, 0.70]}
    for (kind, seed), a in acc.items():
        fake_run(tmp_path / f"kind={kind}_seed={seed}", kind=kind, seed=seed, accuracy=a)
    # failed at step 10 of 20, and one that was stopped without a summary
    fake_run(tmp_path / "kind=hrf_seed=0", kind="hrf", seed=0, accuracy=[0.5], steps=(10,), finished=False,
             status={"status": "failed", "returncode": 3})
    fake_run(tmp_path / "kind=hrf_seed=1", kind="hrf", seed=1, accuracy=[0.6], steps=(10,), finished=False)
    runs = report.collect([tmp_path])
    rep = report.report(runs)
    assert rep["keys"] == ["model.attention.kind", "seed"]           # lr and num_features do not differ
    order = [r["name"] for r in rep["rows"]]
    assert order[:5] == ["kind=favor#_seed=2", "kind=favor#_seed=0", "kind=favor#_seed=1", "kind=relu_seed=0",
                         "kind=relu_seed=1"]
    rows = {r["name"]: r for r in rep["rows"]}
    assert rows["kind=hrf_seed=0"]["status"] == "failed (exit 3) at 10/20"
    assert rows["kind=hrf_seed=1"]["status"] == "unfinished at 10/20" and rows["kind=hrf_seed=1"]["final"] == pytest.approx(0.6)
    assert rows["kind=relu_seed=1"]["best"] == pytest.approx(0.72) and rows["kind=relu_seed=1"]["best_step"] == 10
    groups = {g["settings"]["model.attention.kind"]: g for g in rep["groups"]}
    finals = [acc[("favor#", s)][-1] for s in range(3)]
    mean, sd, n = groups["favor#"]["final"]
    assert n == 3 and mean == pytest.approx(np.mean(finals)) and sd == pytest.approx(np.std(finals, ddof=1))
    best = [max(acc[("relu", s)]) for s in range(2)]
    assert groups["relu"]["best"][0] == pytest.approx(np.mean(best))
    assert groups["hrf"]["finished"] == 0 and groups["hrf"]["final"] == (None, None, 0)
    assert [g["settings"]["model.attention.kind"] for g in rep["groups"]] == ["favor#", "relu", "hrf"]
    text = report.markdown(rep)
    assert "| favor# | 3/3 | 0.92 ± 0.036 |" in text and "failed (exit 3) at 10/20" in text
    # lower-is-better metrics sort the other way
    assert [r["name"] for r in report.report(runs, "loss")["rows"]][0] == "kind=favor#_seed=2"
    report.plot(runs, rep, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_report_nan_metrics_running_runs_and_metric_direction(tmp_path):
    import socket
    fake_run(tmp_path / "good", kind="relu", seed=0, accuracy=[0.5, 0.7])
    fake_run(tmp_path / "diverged", kind="elu", seed=0, accuracy=[float("nan"), 0.9])
    summary = json.loads((tmp_path / "diverged" / "summary.json").read_text())
    (tmp_path / "diverged" / "summary.json").write_text(json.dumps(dict(summary, accuracy=float("nan"))))
    # resumed and running again: the preempted summary.json of its previous process is not its result
    fake_run(tmp_path / "again", kind="hrf", seed=0, accuracy=[0.6, 0.65], steps=(10, 15), finished=False,
             status={"status": "running", "pid": os.getpid(), "host": socket.gethostname()})
    (tmp_path / "again" / "summary.json").write_text(json.dumps({"step": 10, "accuracy": 0.6, "preempted": True}))
    rep = report.report(report.collect([tmp_path]))
    rows = {r["name"]: r for r in rep["rows"]}
    assert [r["name"] for r in rep["rows"]] == ["good", "again", "diverged"]     # NaN last, not first
    assert rows["diverged"]["final"] is None and rows["diverged"]["best"] == pytest.approx(0.9)
    assert rows["again"]["status"] == "running at 15/20" and rows["again"]["final"] == pytest.approx(0.65)
    # a status with no live pid behind it is a stopped run
    (tmp_path / "again" / "sweep_status.json").write_text(json.dumps({"status": "running", "pid": 0,
                                                                       "host": socket.gethostname()}))
    assert report.collect([tmp_path / "again"])[0].status == "preempted at 15/20"
    assert [report.lower_is_better(m) for m in ("loss", "mlm_loss", "eval/wer", "perplexity", "answer_f1",
                                                "accuracy", "lower")] == [True, True, True, True, False, False, False]


def test_report_errors_name_the_bad_input(tmp_path, capsys):
    assert report.main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere is not a sweep directory" in capsys.readouterr().err
    fake_run(tmp_path / "a", kind="relu", seed=0, accuracy=[0.5], steps=(20,))
    with pytest.raises(ValueError, match="metric 'f2' is in no run; the runs have: .*accuracy"):
        report.report(report.collect([tmp_path / "a"]), "f2")
    (tmp_path / "a" / "summary.json").write_text("{trunc")
    with pytest.raises(ValueError, match="summary.json is not valid JSON"):
        report.collect([tmp_path / "a"])


def test_sweep_local_rejects_bad_arguments(tmp_path, capsys):
    """Argument errors, in this process (the launcher's main; the runs above cover it as a program)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("sweep_local", ROOT / "launch/sweep_local.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    config = tmp_path / "c.py"
    config.write_text(textwrap.dedent("""
        def get_config(arg=None):
            return None
        def sweep():
            yield {"seed": 0}
            yield {"seed": 1}
    """))
    for flags, message in ((("--only", "5"), "run 5 does not exist (the sweep has runs 0..1)"),
                           (("--only", "x"), "'x' is not an index"), (("--only", "1-0"), "'1-0' is a reversed range"),
                           (("--only", ","), "names no run"), (("--parallel", "0"), "--parallel 0")):
        with pytest.raises(SystemExit) as e:
            launcher.main(sweep_cmd(config, tmp_path / "s", *flags)[2:])
        assert message in str(e.value.code), e.value.code
    launcher.main(sweep_cmd(config, tmp_path / "s", "--dry-run", "--only", "1", "--", "--config.x=1")[2:])
    dry = capsys.readouterr().out.splitlines()
    assert len(dry) == 1 and dry[0].endswith("--config.seed=1 --config.x=1") and not (tmp_path / "s").exists()


def fake_tools(tmp_path, *names):
    """Stand-ins for cluster tools (srun, gcloud) that record their arguments, one per line, and succeed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in names:
        tool = bin_dir / name
        tool.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> {tmp_path}/{name}.args\necho ---- >> {tmp_path}/{name}.args\n')
        tool.chmod(0o755)
    return {**__import__("os").environ, "PATH": f"{bin_dir}:{__import__('os').environ['PATH']}"}


def test_cluster_launchers_run_one_sweep_run_per_array_task_or_the_sweep_on_the_pod(tmp_path):
    env = fake_tools(tmp_path, "srun", "gcloud")
    slurm = subprocess.run(["bash", str(ROOT / "launch/slurm_gpu.sbatch"), "--sweep", "runs/abl", "--config",
                            "configs/default.py", "--config.total_steps=5"], capture_output=True, text=True,
                           env={**env, "SLURM_ARRAY_TASK_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT)})
    assert slurm.returncode == 0, slurm.stderr
    assert (tmp_path / "srun.args").read_text().split("\n----")[0].splitlines() == [
        ".venv/bin/python", "launch/sweep_local.py", "--config", "configs/default.py", "--workdir", "runs/abl",
        "--only", "7", "--", "--multihost", "--config.total_steps=5"]
    no_array = subprocess.run(["bash", str(ROOT / "launch/slurm_gpu.sbatch"), "--sweep", "runs/abl", "--config",
                               "configs/default.py"], capture_output=True, text=True, env=env)
    assert no_array.returncode == 2 and "needs --array" in no_array.stderr
    pod = subprocess.run(["bash", str(ROOT / "launch/tpu_pod.sh"), "--sweep", "my-tpu", "zone-a", "/mnt/abl", "--",
                          "--config", "configs/default.py", "--config.seed=3"], capture_output=True, text=True, env=env)
    assert pod.returncode == 0, pod.stderr
    ssh = (tmp_path / "gcloud.args").read_text().split("----\n")[1]
    assert ssh.rstrip().endswith(".venv/bin/python launch/sweep_local.py --config configs/default.py --workdir "
                                 "/mnt/abl -- --multihost --config.seed=3"), ssh
    (tmp_path / "gcloud.args").unlink()
    bare = subprocess.run(["bash", str(ROOT / "launch/tpu_pod.sh"), "--sweep", "my-tpu", "zone-a", "/mnt/abl", "--",
                           "--config", "configs/default.py"], capture_output=True, text=True, env=env)
    ssh = (tmp_path / "gcloud.args").read_text().split("----\n")[1]
    assert bare.returncode == 0 and ssh.rstrip().endswith("--workdir /mnt/abl -- --multihost"), ssh   # no '' arg
    # the accelerator benchmark on the slice's first host, its results copied back
    (tmp_path / "gcloud.args").unlink()
    bench = subprocess.run(["bash", str(ROOT / "launch/tpu_pod.sh"), "--bench", "my-tpu", "zone-a",
                            str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert bench.returncode == 0, bench.stderr
    calls = (tmp_path / "gcloud.args").read_text().split("----\n")
    assert all("--worker=0" in call.split() for call in calls if call.strip())
    assert "launch/bench_accel.sh ~/favor-bench grid kinds" in calls[1]
    assert "~/favor-bench/BENCHMARKS.md" in calls[2] and str(tmp_path / "out/BENCHMARKS.tpu.md") in calls[2]
    usage = subprocess.run(["bash", str(ROOT / "launch/tpu_pod.sh"), "--bench", "my-tpu"], capture_output=True,
                           text=True, env=env)
    assert usage.returncode == 2 and "--bench TPU_NAME ZONE OUT" in usage.stderr


def test_report_names_empty_settings_none_and_plots_the_setting_means(tmp_path):
    """An empty override (a key's default, as in qk_norm="") reads "none" in the tables and the plot's
    labels, as in the run names; with seeds the plot has a third panel of per-setting means."""
    for norm, accs in (("", [0.30, 0.40]), ("l2", [0.90, 0.94])):
        for seed, acc in enumerate(accs):
            fake_run(tmp_path / f"kind=favor_qk_norm={norm or 'none'}_seed={seed}", kind="favor", seed=seed,
                     accuracy=[acc / 2, acc], qk_norm=norm)
    runs = report.collect([tmp_path])
    rep = report.report(runs)
    text = report.markdown(rep)
    assert "| none | 2/2 | 0.35 ± 0.071 |" in text and "| l2 | 2/2 | 0.92 ± 0.028 |" in text
    assert report._setting_label(rep["groups"][1]["settings"]) == "qk_norm=none"
    import matplotlib.pyplot as plt
    saved = []
    original = plt.Figure.savefig
    plt.Figure.savefig = lambda fig, *a, **k: (saved.append([ax.get_title() for ax in fig.axes]),
                                               original(fig, *a, **k))
    try:
        report.plot(runs, rep, tmp_path / "plot.png")
    finally:
        plt.Figure.savefig = original
    assert saved[0][2] == "final accuracy per setting" and (tmp_path / "plot.png").stat().st_size > 10_000


READ_EVENTS = """
import sys
from pathlib import Path
from favor.tools import report
print(report.read_events(Path(sys.argv[1])))
assert "tensorflow" not in sys.modules, "tensorflow imported"
"""


def test_report_reads_events_without_tensorflow_and_stops_at_a_record_being_written(tmp_path):
    """The report's reader gives every scalar favor wrote, in step order with the last write of a step
    kept, without importing TensorFlow (seconds of a report's start-up); a record cut short (a run writing
    as the report reads) ends that file's reading where the whole records end."""
    writer = events.ScalarWriter(tmp_path / "tb")
    writer.write_scalars(7, {"loss": 0.75})
    writer.write_scalars(3, {"loss": 1.5, "eval/accuracy": 0.25})
    writer.write_scalars(7, {"loss": np.float32(0.5)})
    writer.close()
    (path,) = (tmp_path / "tb").iterdir()
    whole = path.read_bytes()
    expected = {"loss": [(3, 1.5), (7, 0.5)], "eval/accuracy": [(3, 0.25)]}
    done = subprocess.run([sys.executable, "-c", READ_EVENTS, str(tmp_path / "tb")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ast.literal_eval(done.stdout) == expected
    # the last record (step 7's second write) cut in the middle, as a run writing it leaves the file: the
    # records are framed as [length: uint64][crc: 4 bytes][data][crc: 4 bytes]
    starts, pos = [], 0
    while pos < len(whole):
        starts.append(pos)
        pos += 8 + 4 + struct.unpack("<Q", whole[pos:pos + 8])[0] + 4
    assert pos == len(whole) and len(starts) == 5            # the file version record, then one per scalar
    path.write_bytes(whole[:starts[-1] + (len(whole) - starts[-1]) // 2])
    assert report.read_events(tmp_path / "tb") == {"loss": [(3, 1.5), (7, 0.75)], "eval/accuracy": [(3, 0.25)]}
