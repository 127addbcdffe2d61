"""The training loop: end to end, the step functions alone, sharded layouts, kill/resume, SIGTERM,
damaged checkpoints, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from favor import job, models, sharding, tasks
from favor.train import checkpoint
from favor.config import loading
from favor.train import optim
from favor.attention import schedule
from favor.data.prefetch import prefetch
from favor.train import events, loop, steps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import default as default_config  # noqa: E402


def tiny(**overrides):
    c = default_config.get_config("runlocal")
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


def final_params(workdir):
    """The parameters of the newest checkpoint, as numpy arrays (no target tree needed)."""
    steps = sorted(int(p.name) for p in (Path(workdir) / "checkpoints").iterdir() if p.name.isdigit())
    restored = ocp.StandardCheckpointer().restore(Path(workdir) / "checkpoints" / str(steps[-1]) / "state")
    return steps[-1], [np.asarray(x) for x in jax.tree.leaves(restored["params"])]


def train_cmd(workdir, *flags):
    return [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.py") + ":runlocal",
            "--workdir", str(workdir), *flags]


def test_tiny_config_trains_end_to_end(tmp_path, caplog):
    with caplog.at_level("INFO", logger="favor.train"):
        summary = job.run(tiny(), tmp_path)
    losses = [l for _, l in summary["train_loss_history"]]
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1          # the loss falls
    assert summary["accuracy"] > 0.15 and summary["step"] == 64        # above chance (0.1) after 64 steps
    assert int(summary.state["step"]) == 64 and "params" in summary.state     # the final state comes back
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["train_loss"] == pytest.approx(summary["train_loss"]) and "accuracy" in saved
    assert (tmp_path / "checkpoints" / "64").is_dir()
    # the progress log line and the TensorBoard scalars carry the rates
    assert any("step 64/64: loss" in r.message and "steps/s" in r.message and "examples/s" in r.message
               for r in caplog.records)
    from tensorboard.backend.event_processing import event_accumulator
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"loss", "steps_per_sec", "examples_per_sec", "eval/accuracy"} <= set(events.Tags()["tensors"])


def _step_inputs():
    """A tiny FAVOR++ ViT, its optimizer and train state, and one batch of 8 random images."""
    model = models.get("vit", "tiny", rngs=nnx.Rngs(0), image_size=8, patch_size=2, channels=1, num_classes=10,
                       hidden=16, num_layers=1, heads=2, mlp_dim=32,
                       attention={"kind": "favor++", "num_features": 8})
    tx, lr = optim.make(loading.optim(lr=1e-2, schedule="constant", weight_decay=0.1), total_steps=10)
    rng = np.random.default_rng(0)
    batch = {"image": rng.random((8, 8, 8, 1), np.float32), "label": rng.integers(0, 10, 8).astype(np.int32)}
    static = dict(graphdef=nnx.graphdef(model), task=tasks.get({"name": "classification"}), tx=tx, lr_schedule=lr,
                  redraw=schedule.parse("step"), features_base=jax.random.PRNGKey(7))
    return steps.init_state(model, tx), batch, static


def test_runs_that_differ_in_their_seed_share_their_programs():
    """The seed enters the train step and the initial state as an argument, not as a constant: the lowered
    programs of two seeds are the same text, so a sweep's later seeds reuse the first's compiled programs
    (JAX's persistent cache), while their ω streams and parameters still differ."""
    lowered, keys = {}, {}
    for seed in (0, 1):
        config = tiny(seed=seed, **{"model.attention.redraw": "step"})
        source, task = job.make_data(config)
        model = job.make_model(config, source)
        layout = job.make_layout(model, sharding.make_mesh(config.mesh), config.sharding_rules, source)
        step_fn = job.make_train_step(config, model, task, layout)
        batch = next(iter(source.train_batches(int(config.batch_size), 0, seed)))
        batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), batch)
        init = jax.jit(model.init).lower(job.model_keys(seed)).as_text()
        lowered[seed] = (step_fn.lower(layout.abstract, batch).as_text(), init)
        keys[seed] = (jax.random.key_data(step_fn.features_base), jax.random.key_data(job.model_keys(seed)["params"]))
    assert lowered[0][0] == lowered[1][0]
    assert lowered[0][1] == lowered[1][1]
    assert not np.array_equal(keys[0][0], keys[1][0]) and not np.array_equal(keys[0][1], keys[1][1])


def test_a_non_finite_step_keeps_the_state_and_the_guard_is_linear_in_the_leaves():
    """apply_if_finite: finite loss, gradients and parameters take the update; any NaN or inf keeps every
    updated entry as it was and records the first such step. Its compiled program grows linearly with the
    number of parameter arrays: a select per leaf that recomputed the finiteness of all of them made the
    guard quadratic (most of a small model's train step, in compile time)."""
    def state_of(n, value):
        return {"step": jnp.int32(3), "bad_step": jnp.int32(-1),
                "params": {f"p{i}": jnp.full((3,), value) for i in range(n)},
                "opt_state": {f"m{i}": jnp.full((2,), value) for i in range(n)}}

    guard = jax.jit(lambda s, loss, g, p, o: steps.apply_if_finite(s, loss, g, params=p, opt_state=o))
    old, new = state_of(4, 1.0), state_of(4, 2.0)
    for bad in (None, ("loss", jnp.nan), ("grads", jnp.inf), ("params", -jnp.inf)):
        loss, grads, params = jnp.float32(0.5), new["params"], dict(new["params"])
        if bad and bad[0] == "loss":
            loss = jnp.float32(bad[1])
        elif bad and bad[0] == "grads":
            grads = dict(grads, p2=jnp.array([0.0, bad[1], 0.0]))
        elif bad:
            params["p3"] = jnp.array([bad[1], 0.0, 0.0])
        out = guard(old, loss, grads, params, new["opt_state"])
        assert int(out["step"]) == 4 and int(out["bad_step"]) == (-1 if bad is None else 3), bad
        expect = new if bad is None else old
        for key in ("params", "opt_state"):
            for name, a in out[key].items():
                np.testing.assert_array_equal(np.asarray(a), np.asarray(expect[key][name]), err_msg=f"{bad} {name}")
    # a later bad step leaves the first one recorded
    again = guard(dict(old, bad_step=jnp.int32(1)), jnp.float32(jnp.nan), new["params"], new["params"],
                  new["opt_state"])
    assert int(again["bad_step"]) == 1

    def compiled_size(n):
        s = state_of(n, 1.0)
        return len(guard.lower(s, jnp.float32(0.5), s["params"], s["params"], s["opt_state"]).compile().as_text())
    assert compiled_size(120) < 2.5 * compiled_size(60)


def test_train_step_accumulating_two_microbatches_equals_one_big_batch():
    state, batch, static = _step_inputs()
    one, m1 = jax.jit(partial(steps.train_step, **static, accumulate=1))(state, batch)
    two, m2 = jax.jit(partial(steps.train_step, **static, accumulate=2))(state, batch)
    assert int(one["step"]) == int(two["step"]) == 1 and int(one["bad_step"]) == int(two["bad_step"]) == -1
    for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(two["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(state["params"])))
    assert moved > 1e-3                                                  # the step did update the parameters
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-5)


def test_features_follow_the_redraw_schedule():
    """"every:2": steps 0 and 1 share ω, step 2 draws afresh; the trainer's key is the schedule's."""
    state, _, static = _step_inputs()
    sched = schedule.parse("every:2")
    rests = [steps.with_features(state["params"], state["rest"], graphdef=static["graphdef"],
                                   key=sched.key(static["features_base"], s)) for s in range(3)]
    draws = lambda rest: [np.asarray(x) for x in jax.tree.leaves(rest) if jnp.issubdtype(x.dtype, jnp.floating)]
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(draws(a), draws(b)))
    assert same(rests[0], rests[1]) and not same(rests[0], rests[2])
    # the schedule the trainer is given (job.make_train_step's redraw) keys step 3 with its window, 1
    config = tiny(**{"model.attention.redraw": "every:2"})
    assert np.array_equal(job.redraw_schedule(config).key(job.features_base(config), 3),
                          jax.random.fold_in(job.features_base(config), 1))


LAYOUTS_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
import jax
import jax.numpy as jnp
from favor import job
from tests.test_train import tiny
out = {{}}
for name, mesh in {layouts!r}.items():
    s = job.run(tiny(total_steps=4, checkpoint_every=100, eval_every=4, log_every=1, mesh=mesh), {tmp!r} + "/" + name)
    out[name] = [l for _, l in s["train_loss_history"]]
try:
    job.run(tiny(batch_size=12, mesh={{"data": -1}}), {tmp!r} + "/bad")
except ValueError as e:
    out["batch_error"] = str(e)
print("RESULT" + json.dumps(out))
"""


def test_sharded_layouts_on_8_devices_match_one_device(tmp_path):
    base = job.run(tiny(total_steps=4, checkpoint_every=100, eval_every=4, log_every=1), tmp_path / "one")
    layouts = {"data8": {"data": 8}, "fsdp8": {"fsdp": 8}, "tensor8": {"tensor": 8},
               "mixed": {"data": 2, "fsdp": 2, "tensor": 2}}
    script = LAYOUTS_SCRIPT.format(root=str(ROOT), layouts=layouts, tmp=str(tmp_path))
    from conftest import xla_flags     # here, not at the top: LAYOUTS_SCRIPT imports this module
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    expected = [l for _, l in base["train_loss_history"]]
    for name in layouts:
        np.testing.assert_allclose(out[name], expected, rtol=2e-4, err_msg=name)
    assert "config.batch_size=12: must be a positive integer divisible by the number of data-parallel devices (8)" \
        in out["batch_error"]


def _wait_for(pred, proc, timeout=240):
    t0 = time.time()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"train.py exited early: {proc.stderr.read()[-3000:] if proc.stderr else ''}")
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for a checkpoint")
        time.sleep(0.05)


def _has_step(workdir, minimum):
    d = Path(workdir) / "checkpoints"
    return d.is_dir() and any(p.name.isdigit() and int(p.name) >= minimum for p in d.iterdir())


LONG = ["--config.total_steps=240", "--config.checkpoint_every=40", "--config.eval_every=1000", "--config.log_every=40"]


def test_sigkill_then_rerun_resumes_and_matches_an_uninterrupted_run(tmp_path):
    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(killed, *LONG), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: _has_step(killed, 80), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_at_kill = sorted(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
    assert steps_at_kill[-1] < 240                                   # it really was stopped mid-run
    rerun = subprocess.run(train_cmd(killed, *LONG), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from step" in rerun.stderr
    whole = tmp_path / "whole"
    subprocess.run(train_cmd(whole, *LONG), check=True, capture_output=True, timeout=600)
    (sa, pa), (sb, pb) = final_params(killed), final_params(whole)
    assert sa == sb == 240
    assert max(float(np.max(np.abs(x - y))) for x, y in zip(pa, pb)) < 1e-6


def test_sigterm_saves_the_current_step(tmp_path):
    proc = subprocess.Popen(train_cmd(tmp_path, "--config.total_steps=100000", "--config.checkpoint_every=100000",
                                      "--config.eval_every=100000", "--config.log_every=10000"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: any((tmp_path / "tensorboard").rglob("events.out.tfevents*"))
              if (tmp_path / "tensorboard").is_dir() else False, proc)
    time.sleep(3.0)                                                  # a few hundred steps in
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["preempted"] and 0 < summary["step"] < 100000
    assert final_params(tmp_path)[0] == summary["step"]             # the checkpoint is at the current step


def test_damaged_latest_checkpoint_is_skipped(tmp_path, monkeypatch):
    unraisable = []     # what reaches the interpreter's hook: the damaged restore's stragglers must not
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    job.run(tiny(total_steps=16, checkpoint_every=8, keep_checkpoints=3), tmp_path)
    ckpt_dir = tmp_path / "checkpoints"
    # a save killed mid-write: only orbax's temporary directory exists; it is never a step
    (ckpt_dir / "24.orbax-checkpoint-tmp").mkdir()
    # damage the newest complete step: overwrite its array data files with garbage of the same size
    for f in (ckpt_dir / "16" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(os.urandom(f.stat().st_size))
    resumed = tiny(total_steps=16, checkpoint_every=8, keep_checkpoints=3)
    with pytest.warns(UserWarning, match="checkpoint step 16 .* unreadable or damaged"):
        summary = job.run(resumed, tmp_path)
    assert summary["step"] == 16        # resumed from step 8 and ran the 8 steps again
    ck = checkpoint.Checkpointer(ckpt_dir)
    assert 24 not in ck.steps() and (ckpt_dir / "16.damaged-0").is_dir() and 16 in ck.steps()
    ck.close()
    time.sleep(1.0)      # the failed restore's other reads end in tensorstore's threads meanwhile
    assert not unraisable, [(u.exc_type, u.exc_value) for u in unraisable]
    # anything else still reaches the hook the filter was put in front of
    other = SimpleNamespace(exc_type=ValueError, exc_value=ValueError("x"), exc_traceback=None, err_msg=None,
                            object=None)
    sys.unraisablehook(other)
    assert [type(u.exc_value) for u in unraisable] == [ValueError]


def test_non_finite_loss_stops_naming_the_step(tmp_path, monkeypatch):
    build = job.build_source

    def poisoned(config):          # corrupt data: NaN images give a NaN loss at the first step
        source = build(config)
        source.train = dict(source.train, image=np.full_like(source.train["image"], np.nan))
        return source
    monkeypatch.setattr(job, "build_source", poisoned)
    with pytest.raises(loop.NonFiniteLoss, match="at step 0"):
        job.run(tiny(), tmp_path)
    saved = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()] if (tmp_path / "checkpoints").exists() else []
    assert not saved                     # nothing non-finite was saved


def test_bad_input_is_a_clear_error(tmp_path):
    """run() checks the config as train.py does (tests/test_overrides.py has the command-line side)."""
    with pytest.raises(loading.ConfigError, match=r"config.model.attention.kind='favour': must be one of .*favor\+\+"):
        job.run(tiny(**{"model.attention.kind": "favour"}), tmp_path)
    with pytest.raises(ValueError, match=r"mesh .*'data': 3.* 1 are available"):
        job.run(tiny(mesh={"data": 3}), tmp_path)
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        job.run(tiny(mesh={"model": 1}), tmp_path)
    with pytest.raises(ValueError, match="config.data.name='imagenet2012': must be one of digits, "):
        job.run(tiny(data={"name": "imagenet2012"}), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_prefetch_keeps_the_order_raises_reader_errors_and_stops():
    def items():
        yield from range(5)
        raise RuntimeError("reader failed at item 5")
    p = prefetch(items(), depth=2)
    assert [next(p) for _ in range(5)] == list(range(5))
    with pytest.raises(RuntimeError, match="reader failed at item 5"):
        next(p)
    p.close()
    endless = prefetch(iter(int, 1), depth=2)      # an infinite stream, as train_batches is
    assert next(endless) == 0
    endless.close()
    assert not endless.thread.is_alive()


@pytest.mark.parametrize("kind, qk_norm, warned", [("favor", "", True), ("hrf", "", True), ("favor", "l2", False),
                                                   ("favor+", "", False), ("softmax", "", False)])
def test_sign_indefinite_kinds_without_qk_norm_are_warned(kind, qk_norm, warned, caplog):
    """trig and HRF without queries and keys on a sphere barely learn: building such a model says so and
    names the override that fixes it; positive kinds and normalised runs build silently."""
    config = tiny(**{"model.attention.kind": kind, "model.attention.qk_norm": qk_norm})
    with caplog.at_level("WARNING", logger="favor.train"):
        job.model_builder(config)
    said = [r.getMessage() for r in caplog.records if "qk_norm" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert kind in said[0] and "--config.model.attention.qk_norm=l2" in said[0]


def test_scalar_events_read_back_with_tensorflows_own_reader(tmp_path):
    """favor writes TensorBoard events without TensorFlow: TensorFlow's reader (which checks every
    record's CRC) and TensorBoard's find the same steps, tags and values, and a disabled writer (another
    process of a multi-host run) leaves nothing."""
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator
    writer = events.ScalarWriter(tmp_path / "tb")
    writer.write_scalars(3, {"loss": 1.5, "eval/accuracy": 0.25})
    writer.write_scalars(7, {"loss": np.float32(0.75)})
    live = event_accumulator.EventAccumulator(str(tmp_path / "tb"))     # a run still writing is readable
    live.Reload()
    assert [t.step for t in live.Tensors("loss")] == [3, 7]
    writer.close()
    events.ScalarWriter(tmp_path / "other", enabled=False).close()
    assert not (tmp_path / "other").exists()
    (path,) = (tmp_path / "tb").iterdir()
    seen = [(e.step, v.tag, float(tf.make_ndarray(v.tensor)))
            for e in tf.compat.v1.train.summary_iterator(str(path)) for v in e.summary.value]
    assert seen == [(3, "loss", 1.5), (3, "eval/accuracy", 0.25), (7, "loss", 0.75)]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(t.step, float(tf.make_ndarray(t.tensor_proto))) for t in acc.Tensors("loss")] == [(3, 1.5), (7, 0.75)]
    assert acc.SummaryMetadata("loss").plugin_data.plugin_name == "scalars"


def test_a_run_does_not_import_tensorflow():
    """The training path (job, loop, writer) leaves TensorFlow unloaded: its import costs a process seconds."""
    code = "import sys, favor.job, favor.train.loop; assert 'tensorflow' not in sys.modules, 'tensorflow imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_progress_rates_the_window_between_reports_and_skips_the_first_call(monkeypatch):
    """The first call (the step that compiled) only starts the clock; a report comes at every
    `every_steps`-th step and the last, with steps/s over the window since the previous one, the ETA and
    the share of time in each timed part, and writes steps_per_sec and uptime."""
    clock = iter([0.0, 10.0, 11.0, 14.0, 15.0, 17.0, 18.0, 19.0, 22.0])
    monkeypatch.setattr(events.time, "monotonic", lambda: next(clock))
    written = []
    writer = type("W", (), {"write_scalars": lambda self, step, s: written.append((step, s))})()
    progress = events.Progress(num_train_steps=7, every_steps=3, writer=writer)        # t0 = 0
    assert progress(1) is False                                                       # t = 10: the start
    assert progress(2) is False                                                       # t = 11
    assert progress(3) is True and progress.steps_per_second == pytest.approx(2 / 4)  # t = 14: 2 steps in 4 s
    with progress.timed("eval"):        # the fake clock reads 15 on entry and 17 on exit: 2 s of eval
        pass
    assert progress(4) is False and progress(6) is True                               # t = 19: 3 steps in 5 s
    assert progress.steps_per_second == pytest.approx(3 / 5)
    assert progress.note == "86%, ETA 2s, 11% eval"                                   # 1 step left; 2 of 19 s
    assert progress(7) is True                                                        # t = 22: the last step
    assert [s for s, _ in written] == [3, 6, 7] and set(written[0][1]) == {"steps_per_sec", "uptime"}
    assert written[1][1]["uptime"] == pytest.approx(19.0)


def test_a_restore_logs_no_item_metadata_warning(tmp_path, caplog):
    """orbax warns "Metadata file does not exist" whenever an item directory's metadata is read (as opening
    a run for init_from, generate or inspect does); favor drops that one warning, for item directories only,
    which the same restore shows without the filter."""
    import logging
    from favor.uptrain import init_from
    ck = checkpoint.Checkpointer(tmp_path / "c", asynchronous=False)
    state = {"params": {"w": jnp.arange(3.0)}}
    ck.save(1, state, {"config": "{}"})
    ck.wait()
    abstract = jax.eval_shape(lambda: state)

    def warnings_of_a_restore():
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            got = ck.restore_latest(abstract)
            opened = init_from._open(tmp_path / "c", 1)
        np.testing.assert_array_equal(got[0]["params"]["w"], np.arange(3.0))
        assert opened.param_shapes == {"w": ((3,), np.dtype("float32"))}
        return [r.getMessage() for r in caplog.records if "Metadata file does not exist" in r.getMessage()]

    assert warnings_of_a_restore() == []
    logging.getLogger("absl").removeFilter(checkpoint.ITEM_METADATA_FILTER)
    try:
        assert warnings_of_a_restore()          # orbax's own behaviour: the filter is what silences it
    finally:
        logging.getLogger("absl").addFilter(checkpoint.ITEM_METADATA_FILTER)
