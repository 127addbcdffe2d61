"""A run directory belongs to its run: a start with another configuration, a checkpoint of another model
and a start that fails leave every file as it was; a resume may change only its length and cadence."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from favor import job
from favor.train import checkpoint, rundir
from favor.config import loading

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import default as default_config  # noqa: E402

SHORT = {"total_steps": 8, "checkpoint_every": 8, "eval_every": 8, "log_every": 8}


def tiny(**overrides):
    c = default_config.get_config("runlocal")
    for key, value in {**SHORT, **overrides}.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


def snapshot(directory: Path) -> dict:
    """{relative path: sha256 of the file, or 'dir'} of everything under `directory`."""
    return {str(p.relative_to(directory)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(directory).rglob("*"))}


@pytest.fixture(scope="module")
def softmax_run(tmp_path_factory):
    """A finished softmax run of the default job (8 steps, one checkpoint)."""
    workdir = tmp_path_factory.mktemp("softmax") / "run"
    job.run(tiny(**{"model.attention.kind": "softmax"}), workdir)
    return workdir


@pytest.fixture
def copy(softmax_run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(softmax_run, target)
    return target


@pytest.mark.parametrize("kind", ["favor#", "relu"])
def test_another_kind_in_a_run_directory_is_refused_and_the_run_kept(copy, kind):
    # favor#: other parameter shapes (once read as a damaged checkpoint and set aside); relu: the same
    # shapes (once resumed silently as ReLU attention, its keep rule deleting the softmax steps)
    before = snapshot(copy)
    with pytest.raises(rundir.RunDirError, match=rf"holds a run of another configuration: "
                                                 rf"model.attention.kind='{kind}' here, 'softmax' in the run.*"
                                                 rf"init_from=run:{re.escape(str(copy))}"):
        job.run(tiny(**{"model.attention.kind": kind, "total_steps": 12}), copy)
    assert snapshot(copy) == before


def test_a_resume_may_change_its_length_and_cadence(copy, caplog):
    config = tiny(**{"model.attention.kind": "softmax", "total_steps": 12, "checkpoint_every": 2, "log_every": 2,
                     "eval_every": 4, "keep_checkpoints": 3, "eval_batch_size": 64, "prefetch": 1})
    with caplog.at_level("INFO", logger="favor.train"):
        summary = job.run(config, copy)
    assert "resumed from step 8" in caplog.text and summary["step"] == 12
    assert json.loads((copy / "config.json").read_text())["total_steps"] == 12     # the record follows the run
    assert sorted(int(p.name) for p in (copy / "checkpoints").iterdir()) == [8, 10, 12]


def test_differences_name_every_key_but_the_resumable_ones():
    run = json.loads(tiny().to_json())
    now = json.loads(tiny(**{"total_steps": 99, "mesh.data": 1, "model.attention.impl": "xla", "optim.lr": 0.5,
                             "optim.accumulate_steps": 2, "model.attention.num_features": 32, "seed": 3}).to_json())
    assert rundir.differences(run, now) == [("model.attention.num_features", 16, 32), ("optim.lr", 0.01, 0.5),
                                            ("seed", 0, 3)]
    # the model compares as it is built: a key an older record lacks takes its default (dropout 0.0 is
    # ViT's), an option the kind does not take is no difference
    older = json.loads(tiny().to_json())
    del older["model"]["dropout"]
    softmax = lambda n: json.loads(tiny(**{"model.attention.kind": "softmax",
                                           "model.attention.num_features": n}).to_json())
    assert rundir.differences(older, run) == [] and rundir.differences(softmax(16), softmax(32)) == []
    # another kind is the difference, not the options only the run's kind has
    assert rundir.differences(run, softmax(16)) == [("model.attention.kind", "favor++", "softmax")]
    # an optional setting the run had and this start drops is a difference, in the model or elsewhere
    anti = json.loads(default_config.get_config("runlocal,kind=favor+,antithetic=True").to_json())
    plain = json.loads(default_config.get_config("runlocal,kind=favor+").to_json())
    assert rundir.differences(anti, plain) == [("model.attention.antithetic", True, False)]
    without = json.loads(tiny().to_json())
    del without["optim"]["b1"]
    assert [(k, repr(v)) for k, _, v in rundir.differences(run, without)] == [("optim.b1", "<missing>")]
    # a key only this start has is a newer favor's
    assert rundir.differences(without, run) == []


def test_the_record_is_the_checkpoint_the_resume_would_continue(copy):
    # a config.json that disagrees with the weights (an older favor rewrote it on every start) decides nothing
    record = json.loads((copy / "config.json").read_text())
    record["model"]["attention"]["kind"] = "relu"
    (copy / "config.json").write_text(json.dumps(record))
    before = snapshot(copy)
    with pytest.raises(rundir.RunDirError, match="model.attention.kind='relu' here, 'softmax' in the run"):
        job.run(tiny(**{"model.attention.kind": "relu", "total_steps": 12}), copy)
    assert snapshot(copy) == before


def test_a_start_that_fails_writes_nothing(softmax_run, tmp_path):
    # the source's hidden is 32: the parameters do not fit, found when they are loaded
    bad = tiny(**{"model.attention.kind": "favor+", "model.hidden": 64, "model.init_from": f"run:{softmax_run}"})
    with pytest.raises(loading.ConfigError, match=r"config.model.init_from=.*has shape \(32,\) in the source"):
        job.run(bad, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(loading.ConfigError, match="config.uptrain.lora_targets='nonexistent'"):
        job.run(tiny(**{"model.init_from": f"run:{softmax_run}", "uptrain.trainable": "lora",
                        "uptrain.lora_targets": "nonexistent"}), tmp_path / "empty")
    assert not any((tmp_path / "empty").iterdir())


def _state(shape=(3, 4), name="w"):
    return {"params": {name: jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)},
            "key": jax.random.key(7), "step": jnp.int32(5)}


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def test_a_checkpoint_of_another_model_is_refused_not_set_aside(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", asynchronous=False)
    ckpt.save(5, _state(), {"step": 5})
    ckpt.close()
    before = snapshot(tmp_path)
    for other, says in ((_state((3, 5)), r"params.w has shape \(3, 4\) in the checkpoint, \(3, 5\) in the model"),
                        (_state(name="v"), "params.v is not in the checkpoint; params.w is in the checkpoint but not "
                                           "in the model")):
        reader = checkpoint.Checkpointer(tmp_path / "checkpoints", asynchronous=False)
        with pytest.raises(checkpoint.Mismatch, match=rf"checkpoint 5 in .* does not fit this model: {says}\."):
            reader.restore_latest(_abstract(other))
        reader.close()
        assert snapshot(tmp_path) == before          # nothing renamed, deleted or written
    # the model's own tree restores, typed PRNG keys (saved as their key data) included
    reader = checkpoint.Checkpointer(tmp_path / "checkpoints")
    state, _, step = reader.restore_latest(_abstract(_state()))
    reader.close()
    assert step == 5 and np.array_equal(jax.random.key_data(state["key"]), jax.random.key_data(jax.random.key(7)))


def test_a_mismatch_names_the_parameters_first():
    saved = {"opt_state.0.mu.w": (3,), "params.w": (3,), "step": ()}
    wanted = {"opt_state.0.mu.w": (4,), "params.w": (4,), "step": ()}
    assert checkpoint.mismatch(saved, wanted, most=1) == ("params.w has shape (3,) in the checkpoint, (4,) in the "
                                                         "model and 1 more differences")


def test_a_bench_refused_by_its_workdir_is_one_line(monkeypatch, capsys):
    from favor.bench import cli

    def refuse(*args):
        raise rundir.RunDirError("--workdir w holds a run of another configuration")
    monkeypatch.setattr(cli.SUBCOMMANDS["headline"], "main", refuse)
    with pytest.raises(SystemExit) as e:
        cli.main(["headline"])
    assert e.value.code == 2 and capsys.readouterr().err == "error: --workdir w holds a run of another configuration\n"


def test_a_reader_skips_a_damaged_step_without_renaming_it(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", asynchronous=False)
    for step in (1, 2):
        ckpt.save(step, _state(), {"step": step})
    ckpt.close()
    for f in (tmp_path / "checkpoints" / "2" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(os.urandom(f.stat().st_size))
    before = snapshot(tmp_path)
    import logging
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("absl").addHandler(handler)
    try:
        with pytest.warns(UserWarning, match="checkpoint step 2 .* unreadable or damaged"):
            _, _, step = checkpoint.Checkpointer(tmp_path / "checkpoints", read_only=True).restore_latest(
                _abstract(_state()))
    finally:
        logging.getLogger("absl").removeHandler(handler)
    assert step == 1 and snapshot(tmp_path) == before
    assert not [m for m in seen if m.startswith(checkpoint.READ_ONLY_NOTES)]   # a reader's notes are dropped


def test_a_checkpointer_makes_its_directory_only_when_it_saves(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints")
    assert ckpt.steps() == [] and ckpt.restore_latest(_abstract(_state())) is None
    ckpt.close()
    assert not (tmp_path / "checkpoints").exists()


def _train(workdir, *flags):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.py") +
                           ":runlocal", "--workdir", str(workdir), *flags], capture_output=True, text=True, timeout=300)


def test_train_py_refuses_a_workdir_that_is_not_its_own_in_one_line(copy, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    hf = tmp_path / "bert"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 32}))
    started = tmp_path / "started"            # stopped before its first checkpoint: config.json alone
    started.mkdir()
    (started / "config.json").write_text(tiny().to_json())
    cases = [([str(a_file)], f"error: --workdir {a_file}: {a_file} is a file; the workdir must be a directory"),
             ([str(a_file / "run")], f"error: --workdir {a_file / 'run'}: {a_file} is a file"),
             ([str(hf)], f"error: --workdir {hf}: its config.json is not a favor run's record"),
             ([str(started), "--config.seed=1"], f"error: --workdir {started} holds a run of another configuration: "
                                                 f"seed=1 here, 0 in the run. A resume may change only total_steps"),
             # another attention kind, init_from and LoRA targets over a finished run
             ([str(copy), f"--config.model.init_from=run:{copy}", "--config.uptrain.trainable=lora",
               "--config.uptrain.lora_targets=nonexistent"],
              f"error: --workdir {copy} holds a run of another configuration: model.attention.kind='favor++' here")]
    before = [snapshot(tmp_path), a_file.read_bytes()]
    for (workdir, *flags), says in cases:
        out = _train(workdir, *flags)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert lines[-1].startswith(says), lines[-1]
        # where there is no checkpoint to start from, the way out is another directory, not init_from
        assert ("it saved no checkpoint" in lines[-1]) == (workdir == str(started)), lines[-1]
    assert [snapshot(tmp_path), a_file.read_bytes()] == before


def test_a_decoder_run_recorded_before_document_packing_resumes_as_a_stream():
    """A record without data.packing ran rows across documents: resuming it under the decoder's new default
    ("documents") is a difference, and with --config.data.packing=stream it is the same run."""
    from configs import decoder_lm
    now = json.loads(decoder_lm.get_config("runlocal").to_json())
    old = json.loads(decoder_lm.get_config("runlocal").to_json())
    del old["data"]["packing"]
    assert rundir.differences(old, now) == [("data.packing", "stream", "documents")]
    now["data"]["packing"] = "stream"
    assert rundir.differences(old, now) == []
