"""A bad value for any key a user sets fails before anything is built or compiled, with one last line that
names the key, the value and what is allowed: checked in-process on job.validate for each case,
and through train.py itself for each kind of failure (flag type, validation, unknown key, config arg)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from favor import job
from favor.config import loading
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import default  # noqa: E402

# (key, value as the flag parser hands it over, what the message must say is allowed)
BAD = [
    ("batch_size", 0, "must be a positive integer divisible by the number of data-parallel devices (8)"),
    ("batch_size", -4, "must be a positive integer divisible by the number of data-parallel devices (8)"),
    ("batch_size", 3, "must be a positive integer divisible by the number of data-parallel devices (8)"),
    ("eval_batch_size", 12, "divisible by the number of data-parallel devices (8)"),
    ("optim.lr", -1.0, "must be a finite number > 0"),
    ("optim.lr", float("inf"), "must be a finite number > 0"),
    ("optim.schedule", "cosin", "must be one of cosine, linear, constant"),
    ("optim.name", "lamb", "must be one of adamw, sgd"),
    ("optim.warmup_steps", -1, "must be an integer ≥ 0"),
    ("optim.weight_decay", -0.1, "must be a finite number ≥ 0"),
    ("optim.clip_norm", -1.0, "must be a finite number ≥ 0"),
    ("optim.layer_decay", 1.5, "must be in (0, 1]"),
    ("optim.b1", 1.0, "must be in [0, 1)"),
    ("optim.eps", 0.0, "must be a finite number > 0"),
    ("optim.accumulate_steps", 0, "must be a positive integer"),
    ("optim.accumulate_steps", 3, "must divide the per-device batch (batch_size / 8 devices = 4)"),
    ("total_steps", -1, "must be an integer ≥ 0"),
    ("seed", -1, "must be an integer ≥ 0"),
    ("eval_every", 0, "must be a positive integer"),
    ("checkpoint_every", 0, "must be a positive integer"),
    ("log_every", -5, "must be a positive integer"),
    ("keep_checkpoints", 0, "must be a positive integer"),
    ("prefetch", -1, "must be an integer ≥ 0"),
    ("mesh.data", 3, "has 3 devices but 8 are available"),
    ("mesh.tensor", 0, "must be a positive integer, or -1"),
    ("model.attention.kind", "performer", "must be one of softmax, relu, elu, favor, favor+, favor++, favor#, hrf"),
    ("model.attention.num_features", 0, "num_features must be ≥ 1"),
    ("model.attention.redraw", "sometimes", "must be 'step' (fresh ω from rng each call), 'every:N'"),
    ("model.attention.coupling", "orthogonl", "valid couplings: iid, orthogonal, simplex"),
    ("model.attention.qk_norm", "rms", "unknown qk_norm 'rms'; valid: '', 'l2', 'layernorm'"),
    ("model.attention.qk_radius", 3.0, "qk_radius must be below qk_radius_max"),
    ("model.attention.qk_radius_max", -1.0, "qk_radius_max must be a finite number > 0"),
    ("model.dtype", "float8", "must be one of float32, bfloat16, float16"),
    ("model.hidden", 0, "must be a positive integer"),
    ("model.dropout", 1.0, "must be in [0, 1)"),
    ("model.preset", "huge", "must be one of tiny, mini, small, base, large"),
    ("data.name", "mnist", "must be one of digits, glue, text, causal_text, imagenet, speech, listops, mqar"),
    ("task.name", "segmentation", "must be one of classification, glue, mlm, causal_lm, ctc"),
]


@pytest.fixture
def eight_devices(monkeypatch):
    """validate() sees 8 data-parallel devices, as on an 8-chip host (mesh data = -1 takes them all)."""
    monkeypatch.setattr(jax, "device_count", lambda *a: 8)


@pytest.mark.parametrize("key,value,allowed", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(key, value, allowed, eight_devices):
    config = default.get_config("runlocal")
    *path, last = key.split(".")
    node = config
    for part in path:
        node = node[part]
    node[last] = value
    with pytest.raises(loading.ConfigError) as e:
        job.validate(config)
    assert e.value.key == key and str(e.value).startswith(f"config.{key}={value!r}: ")
    assert allowed in str(e.value)


def test_init_from_must_name_a_source(tmp_path, eight_devices):
    from configs import bert_glue
    config = bert_glue.get_config("task=sst2,runlocal")
    for spec, allowed in (("bert-base-uncased", "must be '' (fresh weights) or name a source: expected 'run:<workdir>'"),
                          (f"hf:{tmp_path / 'missing'}", "is not a directory")):
        config.model.init_from = spec
        with pytest.raises(loading.ConfigError, match="config.model.init_from=") as e:
            job.validate(config)
        assert allowed in str(e.value)
    config.model.init_from = f"hf:{tmp_path}"
    job.validate(config)


# Through train.py: one case per kind of failure, run in parallel (each is a fresh process).
CLI = {
    "flag type": (["--config.optim.lr=abc"], "error: config.optim.lr='abc': must be a number (the config has 0.01)"),
    "validation": (["--config.batch_size=3"], "error: config.batch_size=3: must be a positive integer divisible by "
                                              "the number of data-parallel devices (8)"),
    "unknown key": (["--config.model.atention.kind=favor+"],
                    "error: --config.model.atention.kind: config.model has no key 'atention' (did you mean "
                    "'attention'?); its keys: attention, attention_dropout, channels, "),
    "config arg": ([], "error: --config configs/default.py:runlocall: unknown arg 'runlocall'; valid "
                       "(with defaults): runlocal=False, kind='favor++'"),
}


def test_train_py_ends_with_one_line_naming_the_key(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
    procs = {}
    for name, (flags, _) in CLI.items():
        config = "configs/default.py:" + ("runlocall" if name == "config arg" else "runlocal")
        procs[name] = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), "--config", config, "--workdir", str(tmp_path / name), *flags],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=240)
        last = out.strip().splitlines()[-1]
        assert proc.returncode == 2, (name, out[-3000:])
        assert last.startswith(CLI[name][1]), (name, last)
        assert not (tmp_path / name / "checkpoints").exists(), name      # nothing was built
