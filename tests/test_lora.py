"""LoRA uptraining (favor.models.lora, uptrain.trainable="lora"): adapters that start as the base model,
merge exactly, train alone in both stages with the base weights frozen and absent from the optimizer
state, resume, and fold into the kernels when the run is another run's init_from; on tiny random
GPT-2 and Llama checkpoints written by the tests, and a ViT."""

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor import job, models
from favor.config import loading
from favor.models import lora

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import decoder_lm  # noqa: E402


def _flat(state) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
        out[".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = np.asarray(leaf)
    return out


def test_adapters_start_as_the_base_model_and_merge_exactly():
    """Fresh adapters (B = 0) change no output; with random A and B the model computes what a model
    without adapters computes with kernels W + (α/r)·A B formed here in float64, and lora.merge gives
    those kernels."""
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 12)))
    model = models.get("decoder", "tiny", attention={"kind": "favor+"}, rngs=nnx.Rngs(0))
    base = model(ids)["logits"]
    paths = lora.add(model, 4, 8.0, rngs=nnx.Rngs(1))
    assert paths == sorted(f"layers.{i}.attention.{p}" for i in range(2) for p in ("key", "out", "query", "value"))
    np.testing.assert_array_equal(np.asarray(model(ids)["logits"]), np.asarray(base))
    rng = np.random.default_rng(2)
    for path, m in nnx.iter_graph(model):
        if isinstance(m, models.layers.Dense) and m.lora is not None:
            m.lora.lora_b[...] = jnp.asarray(rng.standard_normal(m.lora.lora_b.shape) * 0.1, jnp.float32)
    adapted = np.asarray(model(ids)["logits"], np.float64)
    flat = _flat(nnx.state(model, nnx.Param))
    want = {}
    for key in [k for k in flat if k.endswith(".lora.lora_a")]:
        stem = key[: -len(".lora.lora_a")]
        want[f"{stem}.kernel"] = (flat[f"{stem}.kernel"].astype(np.float64) + 2.0 * flat[key].astype(np.float64)
                                  @ flat[f"{stem}.lora.lora_b"].astype(np.float64))
    merged = lora.merge(flat, 2.0)
    assert not any("lora" in k for k in merged)
    for k, w in want.items():
        np.testing.assert_allclose(merged[k], w, rtol=1e-6, atol=1e-6)
    plain = models.get("decoder", "tiny", attention={"kind": "favor+"}, rngs=nnx.Rngs(0))
    state = nnx.state(plain, nnx.Param)
    pure = nnx.to_pure_dict(state)
    for k, w in want.items():
        node = pure
        parts = k.split(".")
        for p in parts[:-1]:
            node = node[int(p) if p.isdigit() and int(p) in node else p]
        node[parts[-1]] = jnp.asarray(w, jnp.float32)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(plain, state)
    np.testing.assert_allclose(np.asarray(plain(ids)["logits"], np.float64), adapted, rtol=1e-5, atol=1e-5)


def _hf_decoder(hf_reference, tmp_path, family):
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers
    path = shutil.copytree(hf_reference / family, tmp_path / family)
    words = Tokenizer(tok_models.WordLevel(unk_token="<unk>"))          # ≤ the checkpoints' vocabularies
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(["return the value of the file in a list", "raise an error if the name is not found"] * 5,
                              trainers.WordLevelTrainer(vocab_size=100, special_tokens=["<unk>", "</s>"]))
    words.save(str(path / "tokenizer.json"))
    return path


def _lora_config(path, total=4, transfer=2, **uptrain):
    config = decoder_lm.get_config(f"runlocal,data=local,kind=favor#,init={path}")
    config.uptrain.update(**{"trainable": "lora", "transfer_steps": transfer, "lora_rank": 2, "lora_alpha": 4.0,
                             **uptrain})
    config.total_steps, config.checkpoint_every = total, 1
    config.keep_checkpoints = total
    return config


def _opt_sizes(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree) if np.ndim(x) > 0))


def _check_adapters_only(summary, path, workdir):
    """The base parameters end exactly as the checkpoint has them, every adapter's B has moved from zero,
    the optimizer states hold Adam's two moments for the adapters only, and summary.json counts them."""
    params = _flat(summary.state["params"])
    source = _flat(nnx.state(models.hf.load(path), nnx.Param))
    adapters = {k: v for k, v in params.items() if lora.is_lora_param(k)}
    assert len(adapters) == 2 * 4 * 2                                     # (A, B) × q, k, v, o × 2 layers
    for k, v in params.items():
        if k not in adapters:
            np.testing.assert_array_equal(v, source[k], err_msg=k)
    assert all(np.any(v != 0) for k, v in adapters.items() if k.endswith("lora_b"))
    trained = sum(v.size for v in adapters.values())
    for key in ("opt_state", "transfer_opt_state"):
        assert _opt_sizes(summary.state[key]) == 2 * trained, key
    written = json.loads((workdir / "summary.json").read_text())
    assert written["trainable_params"] == trained
    assert written["trainable_fraction"] == pytest.approx(trained / sum(v.size for v in params.values()))


def test_a_gpt2_lora_run_trains_only_its_adapters(hf_reference, docstrings_cache, tmp_path):
    """Transfer (2 steps) then the LM loss (2 steps), trainable="lora", on a tiny random GPT-2 (biases,
    learned positions, tied embeddings); the Llama layout is the next test's."""
    path = _hf_decoder(hf_reference, tmp_path, "GPT2LMHeadModel")
    _check_adapters_only(job.run(_lora_config(path), tmp_path / "run"), path, tmp_path / "run")


def test_a_llama_lora_run_resumes_and_folds_into_the_next_run(hf_reference, docstrings_cache, tmp_path):
    """On a tiny random Llama (transfer 1 step, then 3): only the adapters train (as for GPT-2 above); a
    run resumed from its step-2 checkpoint ends with the uninterrupted run's parameters; a run started
    from it (init_from=run:) holds kernels W + (α/r)·A B, formed here in float64, no adapters of its own,
    and computes the LoRA model's logits."""
    path = _hf_decoder(hf_reference, tmp_path, "LlamaForCausalLM")
    config = _lora_config(path, total=4, transfer=1)
    summary = job.run(config, tmp_path / "whole")
    _check_adapters_only(summary, path, tmp_path / "whole")
    run = summary.state
    whole = _flat(run["params"])
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "whole", part)
    for step in (3, 4):
        shutil.rmtree(part / "checkpoints" / str(step))
    resumed = _flat(job.run(config, part).state["params"])
    for k in whole:
        np.testing.assert_array_equal(resumed[k], whole[k], err_msg=k)

    follow = decoder_lm.get_config(f"runlocal,data=local,kind=favor#,init={path}")
    follow.model.init_from = f"run:{tmp_path / 'whole'}"
    *_, model_plan, _, state = job.rebuild(follow, tmp_path / "follow")
    got = _flat(state["params"])
    assert not any(lora.is_lora_param(k) for k in got)
    for key in [k for k in whole if k.endswith(".lora.lora_a")]:
        stem = key[: -len(".lora.lora_a")]
        want = whole[f"{stem}.kernel"].astype(np.float64) + 2.0 * (
            whole[key].astype(np.float64) @ whole[f"{stem}.lora.lora_b"].astype(np.float64))
        np.testing.assert_allclose(got[f"{stem}.kernel"], want, rtol=1e-6, atol=1e-6)
    lora_graph = nnx.split(nnx.eval_shape(job.model_builder(config)[0]), nnx.Param, ...)[0]
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 100, (2, 16)))
    # both with the LoRA run's draws and fit statistics: what differs is the adapters against their merge
    a = nnx.merge(lora_graph, run["params"], run["rest"])(ids)["logits"]
    b = nnx.merge(model_plan.graphdef, state["params"], run["rest"])(ids)["logits"]
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)


def test_the_lolcats_recipe_trains_the_maps_then_the_adapters(hf_reference, docstrings_cache, tmp_path):
    """LoLCATs' two stages on a tiny random Llama linearized as hedgehog with a band and the learned mix:
    trainable="feature_maps" (transfer, 2 steps) moves the maps and the mix alone, then finetune="lora"
    (2 steps) the adapters alone; each stage's optimizer holds Adam's moments for its own parameters."""
    path = _hf_decoder(hf_reference, tmp_path, "LlamaForCausalLM")
    config = decoder_lm.get_config(f"runlocal,data=local,kind=hedgehog,window=2,init={path}")
    config.model.attention.window_mix = "learned"
    config.uptrain.update(trainable="feature_maps", finetune="lora", transfer_steps=2, lora_rank=2, lora_alpha=4.0)
    config.total_steps, config.checkpoint_every = 4, 2
    job.validate(config)
    # the checkpoint has no maps and no mix: the load says they start fresh, naming them
    with pytest.warns(UserWarning, match=r"newly initialised .*layers\.0\.attention\.feature_map, "
                                         r"layers\.0\.attention\.window_mix"):
        summary = job.run(config, tmp_path / "run")
    params = _flat(summary.state["params"])
    source = _flat(nnx.state(models.hf.load(path), nnx.Param))
    maps = {k for k in params if k.endswith(("attention.feature_map", "attention.window_mix"))}
    adapters = {k for k in params if lora.is_lora_param(k)}
    assert len(maps) == 2 * 2 and len(adapters) == 2 * 4 * 2
    for k, v in params.items():
        if k not in maps | adapters:
            np.testing.assert_array_equal(v, source[k], err_msg=k)
    start = _flat(nnx.state(job.model_builder(config)[0](), nnx.Param))     # the seed's fresh maps and mix
    assert all(np.any(params[k] != start[k]) for k in maps)
    assert all(np.any(params[k] != 0) for k in adapters if k.endswith("lora_b"))
    assert _opt_sizes(summary.state["transfer_opt_state"]) == 2 * sum(params[k].size for k in maps)
    assert _opt_sizes(summary.state["opt_state"]) == 2 * sum(params[k].size for k in adapters)


def test_lora_config_errors_name_the_key(hf_reference, tmp_path):
    """Bad LoRA settings are one-line config errors before anything is built; targets that select no
    projection name the model's projections."""
    path = _hf_decoder(hf_reference, tmp_path, "LlamaForCausalLM")
    for key, value, words in (("lora_rank", 0, "must be a positive integer"),
                              ("lora_alpha", -1.0, "a positive number"),
                              ("lora_targets", "(", "regular expression")):
        config = _lora_config(path)
        config.uptrain[key] = value
        with pytest.raises(loading.ConfigError, match=f"uptrain.{key}.*{words}"):
            job.validate(config)
    config = _lora_config(path, transfer=0)
    config.model.init_from = ""
    with pytest.raises(loading.ConfigError, match="uptrain.trainable.*needs model.init_from"):
        job.validate(config)
    config = _lora_config(path, transfer=0, trainable="all", finetune="lora")
    config.model.init_from = ""
    with pytest.raises(loading.ConfigError, match="uptrain.finetune='lora': needs model.init_from"):
        job.validate(config)
    config = _lora_config(path, finetune="adapters")
    with pytest.raises(loading.ConfigError, match="uptrain.finetune='adapters': must be one of 'all', 'lora'"):
        job.validate(config)
    config = _lora_config(path, lora_targets=r"attention\.nothing$")
    with pytest.raises(loading.ConfigError, match="uptrain.lora_targets.*select no projection.*layers.0.attention.key"):
        job.run(config, tmp_path / "none")
