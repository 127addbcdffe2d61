"""Requests a run cannot honour are config errors, not tracebacks or silent no-ops: each is refused by the check
job.validate runs before anything is built, naming the key, the value and what is allowed (derived from the
registries, so a new kind is named without a test to update); and through train.py, one line and exit status 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from favor import attention, data, job
from favor.attention import kinds as kinds_lib
from favor.config.checks import ConfigError
from favor.uptrain.transfer import NAMED
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import bert_glue, bert_pretrain, default  # noqa: E402

NO_IMPL = [k for k in attention.names() if "impl" not in attention.get(k).OPTIONS]
MIXING = [k for k in attention.names() if "window_mix" in attention.get(k).OPTIONS]


@pytest.fixture
def source(tmp_path):
    """A directory model.init_from=run:<it> accepts (validate reads no checkpoint)."""
    (tmp_path / "source" / "checkpoints").mkdir(parents=True)
    return tmp_path / "source"


def refused(config, key):
    with pytest.raises(ConfigError) as e:
        job.validate(config)
    assert e.value.key == key, str(e.value)
    return str(e.value)


def transfer(source, kind, trainable="feature_maps", **attention_options):
    config = default.get_config("runlocal")
    config.model.attention.update(kind=kind, **attention_options)
    config.model.init_from = f"run:{source}"
    config.uptrain.update(transfer_steps=4, trainable=trainable)
    return config


# -- uptrain.trainable=feature_maps on a kind with nothing it selects ----------------------------------------
@pytest.mark.parametrize("kind", [k for k in attention.names() if k not in attention.learned_kinds() + ("softmax",)])
def test_feature_maps_on_a_kind_without_learned_maps_names_the_kinds_that_have_them(source, kind):
    message = refused(transfer(source, kind), "uptrain.trainable")
    assert message.startswith(f"config.uptrain.trainable='feature_maps': selects nothing for {kind}: it has no "
                              f"learned feature map (the learned kinds: {', '.join(attention.learned_kinds())})")
    for other in [*(k for k in NAMED if k != "feature_maps"), "lora"]:     # what else trainable takes
        assert repr(other) in message
    assert "regular expression" in message


def test_feature_maps_select_a_learned_kinds_maps_or_a_windows_learned_mix(source):
    assert {"hedgehog", "t2r"} <= set(attention.learned_kinds())
    for kind in attention.learned_kinds():
        job.validate(transfer(source, kind))
    job.validate(transfer(source, "favor+", window=4, window_mix="learned"))   # the mix alone
    job.validate(transfer(source, "favor+", trainable="query_key"))
    assert "no learned window mix" in refused(transfer(source, "favor+", window=4), "uptrain.trainable")


# -- a tokenizer that neither the config nor model.init_from gives -------------------------------------------
def test_glue_without_a_tokenizer_or_a_source_model_is_refused(source):
    config = bert_glue.get_config("task=sst2,runlocal")
    message = refused(config, "data.tokenizer")
    assert message.startswith("config.data.tokenizer='': data.tokenizer is empty and glue trains no tokenizer")
    for form in ("'wordpiece:<vocab.txt>[:cased]'", "'sentencepiece:<model file>'",
                 "'hf:<directory with tokenizer.json>'", "model.init_from=run:", "hf:<a directory with vocab.txt>"):
        assert form in message
    # what the source builds from the same block says the same (a source model that brought none)
    with pytest.raises(ConfigError, match=r"^config\.data\.tokenizer='': data\.tokenizer is empty"):
        data.get(dict(config.data))
    assert data.needs_tokenizer(config.data)
    assert not data.needs_tokenizer(bert_pretrain.get_config("runlocal").data)   # trains its own


def test_a_tokenizer_or_a_source_model_that_brings_one_is_enough(source, tmp_path):
    job.validate(bert_glue.get_config(f"task=sst2,runlocal,vocab={tmp_path / 'vocab.txt'}"))
    for spec in (f"run:{source}", f"hf:{source}"):
        config = bert_glue.get_config("task=docorder,runlocal")
        config.model.init_from = spec
        job.validate(config)
    job.validate(bert_pretrain.get_config("runlocal"))          # MLM text: an empty tokenizer is trained


# -- impl the kind cannot honour -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", NO_IMPL)
def test_an_impl_a_kind_has_no_other_than_xla_for_is_refused(kind):
    config = default.get_config("runlocal")
    config.model.attention.kind = kind
    for impl in ("", "auto", "xla"):                     # XLA: every kind's
        config.model.attention.impl = impl
        job.validate(config)
    for impl, takers in (("pallas", kinds_lib.fused_kinds()), ("pallas-bf16", kinds_lib.fused_kinds()),
                         ("cudnn", ("softmax",))):
        config.model.attention.impl = impl
        message = refused(config, "model.attention.impl")
        assert message.startswith(f"config.model.attention.impl={impl!r}: {kind} runs on XLA alone: impl must be "
                                  "'', 'auto' or 'xla' for it; ")
        assert message.endswith(f" is for {', '.join(takers)}")


def test_the_fused_kernel_kinds_come_from_the_kinds_themselves():
    assert kinds_lib.fused_kinds() == ("favor+", "favor++", "favor#", "simrf")
    config = default.get_config("runlocal")
    config.model.attention.impl = "pallas"
    for kind in kinds_lib.fused_kinds():
        config.model.attention.kind = kind
        job.validate(config)
    config.model.attention.kind = "favor"
    assert f"({', '.join(kinds_lib.fused_kinds())})" in refused(config, "model.attention.impl")


# -- a learned window mix without a window -------------------------------------------------------------------
@pytest.mark.parametrize("kind", MIXING)
def test_a_learned_window_mix_needs_a_window(kind):
    config = default.get_config("runlocal")
    config.model.attention.update(kind=kind, window_mix="learned")
    message = refused(config, "model.attention.window_mix")
    assert message.startswith("config.model.attention.window_mix='learned': ") and "needs a window" in message
    assert "model.attention.window > 0" in message and "'shared'" in message
    if attention.get(kind).positive:
        config.model.attention.window = 4
        job.validate(config)


# -- through train.py: one line, exit status 2 ---------------------------------------------------------------
CLI = {
    "feature_maps": ("configs/default.py:runlocal", ["--config.model.attention.kind=favor+",
                                                     "--config.model.init_from=run:{source}",
                                                     "--config.uptrain.trainable=feature_maps",
                                                     "--config.uptrain.transfer_steps=4"],
                     "error: config.uptrain.trainable='feature_maps': selects nothing for favor+"),
    "tokenizer": ("configs/bert_glue.py:task=sst2", [], "error: config.data.tokenizer='': data.tokenizer is empty"),
    "impl": ("configs/default.py:runlocal",
             ["--config.model.attention.kind=relu", "--config.model.attention.impl=pallas"],
             "error: config.model.attention.impl='pallas': relu runs on XLA alone"),
    "window_mix": ("configs/default.py:runlocal", ["--config.model.attention.window_mix=learned"],
                   "error: config.model.attention.window_mix='learned': "),
}


@pytest.mark.parametrize("case", CLI)
def test_train_py_refuses_in_one_line(case, source, tmp_path):
    config, flags, expected = CLI[case]
    env = dict(os.environ, XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu")
    argv = [sys.executable, str(ROOT / "train.py"), "--config", config, "--workdir", str(tmp_path / "run"),
            *(f.format(source=source) for f in flags)]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: config.") and last.startswith(expected), last
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()              # nothing was built
