"""Uptraining: a favor run's parameters continue under another attention kind (model.init_from), the
day-0 evaluation, the tokenizer that travels with the model, and the attention-transfer stage."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds
from flax import nnx

from favor import data, models, tasks, job, uptrain
from favor.config import loading
from favor.bench import uptrain as bench_uptrain
from favor.data import tokenizers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import bert_glue, bert_pretrain  # noqa: E402

import test_train  # noqa: E402  (its tiny config)
from conftest import docstrings_copy  # noqa: E402


def tiny(kind, **overrides):
    """The tiny digits ViT (test_train.tiny) with attention `kind`."""
    c = test_train.tiny(**overrides)
    c.model.attention.kind = kind
    return c


def saved_params(checkpoints: Path, step: int) -> dict:
    """dotted path -> numpy array, read with orbax alone (no favor code)."""
    restored = ocp.StandardCheckpointer().restore(checkpoints / str(step) / "state")
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict) and set(node) != {"value"}:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = np.asarray(node["value"] if isinstance(node, dict) else node)
    walk(restored["params"], "")
    return flat


def dotted(path) -> str:
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return ".".join(parts[:-1] if parts[-1] == "value" else parts)     # a Variable's own value, not a module


def state_params(state) -> dict:
    return {dotted(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


@pytest.fixture(scope="module")
def softmax_run(tmp_path_factory):
    """A softmax digits ViT trained long enough that its attention is far from uniform."""
    workdir = tmp_path_factory.mktemp("softmax_source")
    job.run(tiny("softmax", total_steps=48, checkpoint_every=24, eval_every=48), workdir)
    return workdir


def test_softmax_run_continues_as_favor_sharp_with_a_day_0_eval(softmax_run, tmp_path, caplog):
    config = tiny("favor#", total_steps=0)
    config.model.init_from = f"run:{softmax_run}"
    with caplog.at_level("INFO", logger="favor.train"):
        summary = job.run(config, tmp_path)
    # the parameters are the source's, bit for bit
    source = saved_params(softmax_run / "checkpoints", 48)
    got = state_params(summary.state["params"])
    assert set(got) == set(source)
    for path in source:
        np.testing.assert_array_equal(got[path], source[path], err_msg=path)
    assert any("init_from run:" in r.message and "step 48" in r.message for r in caplog.records)
    # day 0: one evaluation at step 0, in summary.json and TensorBoard
    history = json.loads((tmp_path / "summary.json").read_text())["eval_history"]
    assert [e["step"] for e in history] == [0]
    from tensorboard.backend.event_processing import event_accumulator
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Tensors("eval/accuracy")] == [0]

    # ... equal to evaluating the source's parameters with FAVOR# built here: the model from the zoo,
    # the saved arrays put in by path, ω drawn from the run's evaluation key
    model = models.get("vit", "tiny", **{k: v for k, v in job.model_builder(config)[1].items()})
    params = nnx.state(model, nnx.Param)
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, [source[dotted(p)] for p, _ in paths]))
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), job.EVAL_FEATURES_STREAM)
    models.redraw_features(model, key)
    source_data, task = data.get(config.data), tasks.get(config.task)
    outputs = [jax.device_get(task.eval_outputs(model, b)) for b in source_data.eval_batches(config.eval_batch_size)]
    expected = task.finalize(outputs)
    assert summary["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-9)
    assert history[0]["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    # the benchmark's day-0 evaluations (one load, one compile, a draw per seed) agree with the run's
    draws = bench_uptrain.day0(config, tmp_path / "bench", [0, 1])
    assert draws[0]["loss"] == pytest.approx(history[0]["loss"], rel=1e-5)
    assert draws[1]["loss"] != pytest.approx(draws[0]["loss"], rel=1e-5)      # another ω, another estimate


def test_favor_sharp_on_a_trained_model_is_the_same_eager_and_jitted(softmax_run):
    """Before SDERF's eigenvector signs were fixed (stats.canonical_signs), this model's FAVOR# logits
    differed by 1.09 between an eager and a jitted forward and 4 of 128 predictions changed: the two
    eigensolver calls returned eigenvectors of other signs, and those rotate the data ω meets (another
    draw). With fixed signs the two agree to float32 rounding."""
    config = tiny("favor#")
    model = models.get("vit", "tiny", **job.model_builder(config)[1])
    source = saved_params(softmax_run / "checkpoints", 48)
    paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, [source[dotted(p)] for p, _ in paths]))
    images = next(iter(data.get(config.data).eval_batches(128)))["image"]
    eager = model(images)["logits"]
    jitted = nnx.jit(lambda m, x: m(x))(model, images)["logits"]
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), atol=1e-3)


def test_uptrain_benchmark_writes_its_table_and_plot(tmp_path):
    curve = lambda *v: [(i * 10, x) for i, x in enumerate(v)]
    results = {"source": {"steps": 1500, "accuracy": 0.96}, "kinds": {
        "favor#": {"day0": [0.95, 0.94], "uptrain": {"final": 0.96, "curve": curve(0.95, 0.96)},
                   "transfer": {"final": 0.965, "curve": curve(0.95, 0.96, 0.965),
                                "attention_mse": {"0": [0.2, 0.4], "20": [0.1, 0.1]}},
                   "scratch": {"final": 0.5, "curve": curve(0.1, 0.5)}}}}
    text = bench_uptrain.table(results, "accuracy", 20, 20, 2)
    assert "| favor# | 94.5 ± 0.7 | 96.0 | 96.5 | 0.3 → 0.1 | 50.0 |" in text
    assert "| softmax (source, 1500 steps) | 96.0 |" in text
    bench_uptrain.plot(results, "accuracy", tmp_path / "p.png", "title")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_init_from_mismatches_and_bad_sources_are_clear_errors(softmax_run, tmp_path):
    config = tiny("favor+", total_steps=0, **{"model.hidden": 64})
    config.model.init_from = f"run:{softmax_run}"
    with pytest.raises(ValueError, match=r"parameter \S+ has shape \(.*\) in the source and \(.*\) in this config's "
                                         r"model \(the source's model: --config.model.hidden=32\)"):
        job.run(config, tmp_path / "a")
    config = tiny("favor+", total_steps=0)
    config.model.init_from = f"run:{softmax_run}@7"
    with pytest.raises(ValueError, match="no step 7 in .*; it has 24, 48"):
        job.run(config, tmp_path / "b")
    for spec, allowed in ((f"run:{tmp_path / 'nothing'}", "is not a favor run directory"),
                          (f"run:{softmax_run}@last", "is not a number"),
                          ("bert-base-uncased", "expected 'run:<workdir>'")):
        config.model.init_from = spec
        with pytest.raises(loading.ConfigError, match="config.model.init_from=") as e:
            job.validate(config)
        assert allowed in str(e.value)
    # a relative path (as a user types it) reads the same checkpoint: orbax needs absolute paths
    import os
    here = os.getcwd()
    try:
        os.chdir(softmax_run.parent)
        relative = uptrain.parse(f"run:{softmax_run.name}")
        assert relative.path.is_absolute() and uptrain.open_checkpoint(relative).step == 48
    finally:
        os.chdir(here)
    # a favor checkpoint directory, the run's or one step's, names the same source
    for spec, step in ((str(softmax_run / "checkpoints"), None), (str(softmax_run / "checkpoints" / "24"), 24)):
        assert uptrain.parse(spec).step == step and uptrain.parse(spec).workdir == softmax_run
    # a BERT config cannot start from a ViT run
    glue = bert_glue.get_config("task=sst2,runlocal,vocab=unused.txt")
    glue.model.init_from = f"run:{softmax_run}"
    with pytest.raises(ValueError, match="the source is a vit run; this config builds a bert"):
        uptrain.load_params(glue, uptrain.parse(glue.model.init_from), None, None)


def test_resumed_uptraining_never_reinitialises_from_the_source(softmax_run, tmp_path, monkeypatch, caplog):
    config = tiny("favor+", total_steps=8, checkpoint_every=4, eval_every=8)
    config.model.init_from = f"run:{softmax_run}"
    first = job.run(config, tmp_path)
    assert [e["step"] for e in first["eval_history"]] == [0, 8]

    def no_source(*args, **kwargs):
        raise AssertionError("a resumed run read its init_from source")
    monkeypatch.setattr(uptrain, "load_params", no_source)
    config.total_steps = 12
    with caplog.at_level("INFO", logger="favor.train"):
        second = job.run(config, tmp_path)
    assert second["step"] == 12 and any("resumed from step 8" in r.message for r in caplog.records)
    assert [e["step"] for e in second["eval_history"]] == [12]        # no second day-0 evaluation


def test_attention_transfer_lowers_the_attention_error_and_moves_only_the_chosen_parameters(softmax_run, tmp_path):
    config = tiny("favor+", total_steps=30, checkpoint_every=30, eval_every=30)
    config.model.init_from = f"run:{softmax_run}"
    config.uptrain.update(transfer_steps=30, lr=3e-3)
    summary = job.run(config, tmp_path)
    before, after = summary["attention_mse"]["0"], summary["attention_mse"]["30"]
    assert len(before) == config.model.num_layers
    assert all(a < 0.8 * b for a, b in zip(after, before)), (before, after)   # held-out batches, fixed ω
    source, got = saved_params(softmax_run / "checkpoints", 48), state_params(summary.state["params"])
    moved = {p for p in source if not np.array_equal(source[p], got[p])}
    assert moved == {f"layers.0.attention.{w}.{b}" for w in ("query", "key") for b in ("kernel", "bias")}
    teacher = state_params(summary.state["teacher"])
    assert all(np.array_equal(teacher[p], source[p]) for p in source)       # the teacher stays the source
    from tensorboard.backend.event_processing import event_accumulator
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Tensors("transfer/eval_mse_layer_0")] == [0, 30]
    assert "transfer/mse_layer_0" in events.Tags()["tensors"]

    config.uptrain.trainable = "no_such_parameter"
    with pytest.raises(loading.ConfigError, match="config.uptrain.trainable='no_such_parameter': selects no "
                                                    "parameter of this model"):
        job.run(config, tmp_path / "none")
    assert not (tmp_path / "none").exists()                  # a start that fails writes nothing
    for key, value, allowed in (("uptrain.transfer_steps", 31, "must be at most total_steps (30)"),
                                ("uptrain.trainable", "(", "must be 'query_key', 'all', 'feature_maps', 'lora' or a regular")):
        bad = config.copy_and_resolve_references()
        bad.uptrain[key.split(".")[1]] = value
        with pytest.raises(loading.ConfigError, match=f"config.{key}="):
            job.validate(bad)
    fresh = tiny("favor+")
    fresh.uptrain.transfer_steps = 4
    with pytest.raises(loading.ConfigError, match="needs model.init_from"):
        job.validate(fresh)


def test_sigkill_during_transfer_resumes_to_the_same_result(softmax_run, tmp_path):
    flags = [f"--config.model.init_from=run:{softmax_run}", "--config.model.attention.kind=favor#",
             "--config.total_steps=60", "--config.uptrain.transfer_steps=40", "--config.checkpoint_every=10",
             "--config.eval_every=1000", "--config.log_every=20"]
    killed, ckpts = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    proc = subprocess.Popen(test_train.train_cmd(killed, *flags), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    test_train._wait_for(lambda: test_train._has_step(killed, 10), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert at_kill < 40                                           # killed inside the transfer stage
    rerun = subprocess.run(test_train.train_cmd(killed, *flags), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from step {at_kill}" in rerun.stderr
    config = tiny("favor#", total_steps=60, checkpoint_every=10, eval_every=1000, log_every=20)
    config.model.init_from = f"run:{softmax_run}"
    config.uptrain.transfer_steps = 40
    whole = job.run(config, tmp_path / "whole")
    a, b = saved_params(ckpts, 60), state_params(whole.state["params"])
    assert max(float(np.max(np.abs(a[p] - b[p]))) for p in a) < 1e-6
    resumed = json.loads((killed / "summary.json").read_text())
    assert resumed["accuracy"] == pytest.approx(whole["accuracy"], abs=1e-6)


def test_lora_uptrains_a_vit_with_its_base_frozen(softmax_run, tmp_path):
    """trainable="lora" on the digits ViT (attention transfer, then the classification loss): only the
    adapters move, the base parameters stay the source's, and the attention error still falls."""
    config = tiny("favor+", total_steps=24, checkpoint_every=24, eval_every=24)
    config.model.init_from = f"run:{softmax_run}"
    # at 1e-3 16 steps took the error from 0.256 to 0.191 here (query and key projections: 0.211); at 3e-3
    # the adapters (scaled by α/r = 4) overshot it
    config.uptrain.update(transfer_steps=16, lr=1e-3, trainable="lora", lora_rank=4)
    summary = job.run(config, tmp_path)
    before, after = summary["attention_mse"]["0"], summary["attention_mse"]["16"]
    assert all(a < 0.9 * b for a, b in zip(after, before)), (before, after)
    source, got = saved_params(softmax_run / "checkpoints", 48), state_params(summary.state["params"])
    assert all(np.array_equal(source[p], got[p]) for p in source)
    adapters = [p for p in got if p not in source]
    assert sorted(adapters) == sorted(f"layers.0.attention.{w}.lora.lora_{m}" for w in ("query", "key", "value", "out")
                                      for m in "ab")
    assert summary["trainable_params"] == sum(got[p].size for p in adapters)


@pytest.mark.parametrize("kind", ["hedgehog", "t2r"])
def test_learned_feature_maps_train_alone_in_attention_transfer(softmax_run, tmp_path, kind):
    """A softmax ViT continued as a learned kind: its feature maps start fresh (the source has none),
    trainable="feature_maps" moves them alone in the transfer stage (LoLCATs' first stage), and the
    attention error against softmax falls. Hedgehog runs with a band and LoLCATs' learned mix, whose
    logits start fresh and train with the maps."""
    config = tiny(kind, total_steps=16, checkpoint_every=16, eval_every=16)
    config.model.attention.num_features = 32
    if kind == "hedgehog":
        config.model.attention.update(window=2, window_mix="learned")
    config.model.init_from = f"run:{softmax_run}"
    config.uptrain.update(transfer_steps=16, lr=1e-2, trainable="feature_maps")
    summary = job.run(config, tmp_path)
    before, after = summary["attention_mse"]["0"], summary["attention_mse"]["16"]
    assert all(a < 0.9 * b for a, b in zip(after, before)), (before, after)
    source, got = saved_params(softmax_run / "checkpoints", 48), state_params(summary.state["params"])
    teacher = state_params(summary.state["teacher"])
    moved = {p for p in got if p not in source or not np.array_equal(source[p], got[p])}
    maps = {"layers.0.attention.feature_map"} | ({"layers.0.attention.window_mix"} if kind == "hedgehog" else set())
    assert moved == maps
    assert not np.array_equal(teacher["layers.0.attention.feature_map"], got["layers.0.attention.feature_map"])


@pytest.fixture
def corpus(tmp_path_factory, monkeypatch, built_docstrings):
    """A fresh data cache with the docstring corpus in it and nothing else (no tokenizer trained yet)."""
    path = docstrings_copy(tmp_path_factory, built_docstrings)
    monkeypatch.setenv("FAVOR_DATA_DIR", str(path))
    return path


def test_pretraining_tokenizer_travels_to_glue_fine_tuning(corpus, tmp_path, caplog):
    pre = bert_pretrain.get_config("runlocal")
    pre.total_steps, pre.checkpoint_every, pre.eval_every = 4, 4, 4
    job.run(pre, tmp_path / "pretrain")
    recorded = tmp_path / "pretrain" / "tokenizer"
    assert json.loads((recorded / "favor_tokenizer.json").read_text()) == {"spec": "sentencepiece:sentencepiece.model"}
    cached = sorted((corpus / "favor_tokenizers").glob("*.model"))      # the one pretraining trained and used
    assert len(cached) == 1

    glue = bert_glue.get_config("task=sst2,runlocal")                     # no vocab, no tokenizer flag
    assert glue.data.tokenizer == ""
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
        with pytest.raises(ValueError, match="data.tokenizer is empty"):
            job.run(glue, tmp_path / "no_tokenizer")
        glue.model.init_from = f"run:{tmp_path / 'pretrain'}"
        with caplog.at_level("INFO", logger="favor.train"):
            summary = job.run(glue, tmp_path / "glue")
    assert summary["step"] == glue.total_steps and np.isfinite(summary["train_loss"])
    assert [e["step"] for e in summary["eval_history"]] == [0, glue.total_steps]
    assert any("tokenizer: sentencepiece:" in r.message and "source model" in r.message for r in caplog.records)
    assert any("newly initialised" in r.message and "classifier" in r.message for r in caplog.records)
    # the fine-tuning run encodes text with the pretraining tokenizer: same ids for the same text
    used = uptrain.recorded_tokenizer(tmp_path / "glue")
    texts = ["the quick brown fox returns a list of values", "Raise ValueError when the path is missing."]
    assert tokenizers.get(used).ids(texts) == tokenizers.SentencePiece(cached[0]).ids(texts)
