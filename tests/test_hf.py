"""Hugging Face import: tiny random BERT/ViT/GPT-2/Llama models built with transformers (torch CPU) are
saved, imported with favor.models.hf.load, and must give the same outputs (softmax attention).
transformers has no Flax models; torch is only the reference here, and it runs in a process of its
own (tests/hf_reference.py, the `hf_reference` fixture): these tests read its checkpoints and outputs."""

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from favor import models
from favor.config import loading
from hf_reference import inputs, long_inputs

ROOT = Path(__file__).resolve().parents[1]

TOL = 1e-4


def reference(root, case):
    return root / case, dict(np.load(root / case / "reference.npz"))


def bert_inputs():
    ids, types, mask, _ = inputs()
    return jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask), mask.astype(bool)


@pytest.mark.parametrize("case", ["BertModel", "BertForMaskedLM", "BertForSequenceClassification"])
def test_bert_matches_hugging_face(hf_reference, case):
    path, ref = reference(hf_reference, case)
    ids, types, mask, valid = bert_inputs()
    ours = models.hf.load(path)(ids, types, mask)
    ref_hidden = ref["last_hidden_state"] if case == "BertModel" else ref["hidden"]
    assert np.max(np.abs(np.asarray(ours["hidden_states"]) - ref_hidden)[valid]) < TOL
    if case == "BertModel":
        np.testing.assert_allclose(np.asarray(ours["pooled"]), ref["pooler_output"], atol=TOL)
    elif case == "BertForMaskedLM":
        assert np.max(np.abs(np.asarray(ours["logits"]) - ref["logits"])[valid]) < TOL
    else:
        np.testing.assert_allclose(np.asarray(ours["logits"]), ref["logits"], atol=TOL)


def test_bert_regression_head(hf_reference):
    path, ref = reference(hf_reference, "stsb")
    ids, types, mask, _ = bert_inputs()
    model = models.hf.load(path)
    assert model.config["head"] == "regression"
    np.testing.assert_allclose(np.asarray(model(ids, types, mask)["logits"]), ref["logits"][:, 0], atol=TOL)


@pytest.mark.parametrize("case", ["ViTModel", "ViTForImageClassification"])
def test_vit_matches_hugging_face(hf_reference, case):
    path, ref = reference(hf_reference, case)
    ours = models.hf.load(path)(jnp.asarray(inputs()[3]))
    if case == "ViTModel":
        np.testing.assert_allclose(np.asarray(ours["hidden_states"]), ref["last_hidden_state"], atol=TOL)
        np.testing.assert_allclose(np.asarray(ours["pooler_output"]), ref["pooler_output"], atol=TOL)
    else:
        np.testing.assert_allclose(np.asarray(ours["logits"]), ref["logits"], atol=TOL)


def test_uptraining_import_keeps_the_parameter_tree(hf_reference):
    path, _ = reference(hf_reference, "BertForMaskedLM")
    soft = models.hf.load(path)
    fav = models.hf.load(path, attention={"kind": "favor++", "num_features": 512})
    tree = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Param))
    a, b = tree(soft), tree(fav)
    assert jnp.array_equal(a["word_embeddings"]["embedding"], b["word_embeddings"]["embedding"])
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    ids, types, mask, valid = bert_inputs()
    out_s = soft(ids, types, mask)["hidden_states"]
    out_f = fav(ids, types, mask)["hidden_states"]
    # FAVOR++ with many features approximates the imported softmax model (not exactly)
    err = np.abs(np.asarray(out_f) - np.asarray(out_s))[valid]
    assert np.all(np.isfinite(err)) and 0 < err.mean() < 0.1


def test_fine_tuning_head_is_fresh_and_named(hf_reference):
    path, _ = reference(hf_reference, "BertModel")
    with pytest.warns(UserWarning, match="newly initialised.*classifier"):
        model = models.hf.load(path, head="classification", num_labels=4)
    assert model(bert_inputs()[0])["logits"].shape == (3, 4)


def test_unknown_or_missing_tensors_are_named(hf_reference, tmp_path):
    path = shutil.copytree(hf_reference / "BertModel", tmp_path / "bert")      # edited below
    tensors = load_file(str(path / "model.safetensors"))
    extra = dict(tensors, **{"encoder.layer.0.attention.self.rotary.weight": np.zeros((2,), np.float32)})
    save_file(extra, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="no favor parameter: encoder.layer.0.attention.self.rotary.weight"):
        models.hf.load(path)
    missing = {k: v for k, v in tensors.items() if k != "encoder.layer.1.output.dense.weight"}
    save_file(missing, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing from the checkpoint: layers.1.mlp.output.kernel"):
        models.hf.load(path)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        models.hf.load(path, hidden=64, heads=4)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, architectures=["T5ForConditionalGeneration"])))
    with pytest.raises(ValueError, match="T5ForConditionalGeneration.*BertModel"):
        models.hf.load(path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.hf.load(tmp_path / "nowhere")


# case -> (rotary base, rope_scaling, qkv_bias, tied embeddings) the import must read from config.json
DECODER_CASES = {
    "GPT2LMHeadModel": (None, "", False, True),
    "LlamaForCausalLM": (500.0, "", False, False),
    "llama3": (500.0, "llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=16",
               False, False),
    "llama-linear": (500.0, "linear:factor=2", False, False),
    "Qwen2ForCausalLM": (1e6, "", True, True),
    "qwen2-untied": (1e6, "", True, False),
    "MistralForCausalLM": (10000.0, "", False, False),
}


@pytest.mark.parametrize("case", list(DECODER_CASES))
def test_decoders_match_hugging_face(hf_reference, case):
    """GPT-2 (fused c_attn split, tied output), Llama 2 and 3.x (grouped-query attention repeated, RMSNorm,
    SwiGLU, rotary positions at base 500; Llama 3.1's and linear rescaled frequencies), Qwen2 (biases on
    q/k/v, repeated with their heads; tied or untied embeddings) and Mistral: favor's softmax logits equal
    transformers' at every real token, and over 40 tokens, past the rescaled cases' original window of 16."""
    path, ref = reference(hf_reference, case)
    ids, _, mask, valid = bert_inputs()
    model = models.hf.load(path)
    base, scaling, qkv_bias, tied = DECODER_CASES[case]
    c = model.config
    assert c["norm"] == ("layer" if case.startswith("GPT2") else "rms") and c["tie_embeddings"] == tied
    assert (c["rotary_base"], c["rope_scaling"], c["qkv_bias"]) == (base, scaling, qkv_bias) or base is None
    ours = np.asarray(model(ids, mask)["logits"])
    assert np.max(np.abs(ours - ref["logits"])[valid]) < TOL
    long = jnp.asarray(long_inputs())
    assert np.max(np.abs(np.asarray(model(long)["logits"]) - ref["long_logits"])) < TOL
    if scaling:         # the rescaling is what makes them equal: the default frequencies do not
        plain = models.hf.load(path, rope_scaling="")
        assert np.max(np.abs(np.asarray(plain(long)["logits"]) - ref["long_logits"])) > 10 * TOL
    # the same weights under a linear kind: a causal FAVOR+ model of the same parameter tree
    fav = models.hf.load(path, attention={"kind": "favor+", "num_features": 256})
    assert jax.tree.structure(nnx.state(fav, nnx.Param)) == jax.tree.structure(nnx.state(model, nnx.Param))
    err = np.abs(np.asarray(fav(ids, mask)["logits"]) - ref["logits"])[valid]
    assert np.all(np.isfinite(err)) and 0 < err.mean() < 0.5


def test_decoder_checkpoints_favor_cannot_compute_are_refused_by_name(hf_reference, tmp_path):
    path = shutil.copytree(hf_reference / "LlamaForCausalLM", tmp_path / "llama")
    cfg = json.loads((path / "config.json").read_text())
    for bad, match in ((dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                        r"Llama rope scaling 'dynamic' is not supported; .* 'linear', 'llama3' \(dynamic NTK's"),
                       (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "rope scaling 'yarn' is not supported"),
                       (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                        "rope scaling 'llama3' lacks low_freq_factor, high_freq_factor in config.json"),
                       (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                           "high_freq_factor": 1.0}), "0 < low_freq_factor < high_freq_factor"),
                       (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
                       (dict(hidden_act="gelu"), "hidden_act 'gelu'"), (dict(attention_bias=True), "attention_bias"),
                       (dict(num_key_value_heads=3), "num_key_value_heads 3 does not divide")):
        (path / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ValueError, match=match):
            models.hf.load(path)
    # checkpoints saved before transformers 5 keep the type as "type" and the base as rope_theta
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    (path / "config.json").write_text(json.dumps({**old, "rope_theta": 250.0, "rope_scaling": {"type": "linear",
                                                                                                 "factor": 4.0}}))
    assert {k: models.hf.decoder_config(path)[k] for k in ("rotary_base", "rope_scaling")} == \
        {"rotary_base": 250.0, "rope_scaling": "linear:factor=4"}
    (path / "config.json").write_text(json.dumps(cfg))
    # a sliding window shorter than the positions the model takes is another computation; none, or one
    # covering every position, is the same
    mistral = shutil.copytree(hf_reference / "MistralForCausalLM", tmp_path / "mistral")
    qwen2 = shutil.copytree(hf_reference / "Qwen2ForCausalLM", tmp_path / "qwen2")
    for where, family, window in ((mistral, "Mistral", {"sliding_window": 8}),
                                  (qwen2, "Qwen2", {"sliding_window": 8, "use_sliding_window": True})):
        ok = json.loads((where / "config.json").read_text())
        (where / "config.json").write_text(json.dumps({**ok, **window}))
        with pytest.raises(ValueError, match=f"{family} sliding_window 8 < max_position_embeddings 64 is not "
                                             f"supported: favor's decoder attends over the whole prefix"):
            models.hf.load(where)
        (where / "config.json").write_text(json.dumps({**ok, **window, "sliding_window": 64}))
        models.hf.load(where)
    ok = json.loads((qwen2 / "config.json").read_text())
    (qwen2 / "config.json").write_text(json.dumps({**ok, "sliding_window": 8, "use_sliding_window": False}))
    models.hf.load(qwen2)                   # Qwen2 honours its window only with use_sliding_window
    tensors = load_file(str(path / "model.safetensors"))
    save_file(dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros((4,), np.float32)}),
              str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="no favor parameter: layers.0.self_attn.rotary_emb.inv_freq"):
        models.hf.load(path)
    gpt2 = shutil.copytree(hf_reference / "GPT2LMHeadModel", tmp_path / "gpt2")
    tensors = load_file(str(gpt2 / "model.safetensors"))
    save_file(dict(tensors, **{"lm_head.weight": np.ones_like(tensors["transformer.wte.weight"])}),
              str(gpt2 / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight differs from the token embeddings"):
        models.hf.load(gpt2)
    # old GPT-2 files carry causal-mask buffers (a [1, 1, P, P] bias and a scalar masked_bias): not weights
    buffers = {"transformer.h.0.attn.bias": np.tril(np.ones((1, 1, 40, 40), np.float32)),
               "transformer.h.0.attn.masked_bias": np.asarray(-1e4, np.float32)}
    save_file(dict(tensors, **buffers), str(gpt2 / "model.safetensors"))
    models.hf.load(gpt2)


@pytest.mark.parametrize("case", ["llama3", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_imported_decoders_decode_as_their_full_pass(hf_reference, case):
    """Prefill and token-by-token decoding give the full causal pass's logits at every position, with
    softmax's key/value cache and with FAVOR+'s fixed-size linear state, for each imported family (the
    prompt of 20 longer than Llama 3.1's original window of 16)."""
    ids = jnp.asarray(long_inputs()[:, :26])
    for kind in ("softmax", "favor+"):
        attention = {"kind": "softmax"} if kind == "softmax" else {"kind": kind, "num_features": 64}
        model = models.hf.load(hf_reference / case, attention=attention)
        graphdef, state = nnx.split(model)
        full = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)["logits"])(state, ids)
        prefill = jax.jit(lambda s, x: nnx.merge(graphdef, s).prefill(x, max_length=32))
        decode = jax.jit(lambda s, t, p, c: nnx.merge(graphdef, s).decode(t, p, c))
        logits, caches = prefill(state, ids[:, :20])
        got = [logits]
        for position in range(20, 26):
            step, caches = decode(state, ids[:, position], jnp.int32(position), caches)
            got.append(step[:, None])
        np.testing.assert_allclose(np.concatenate(got, axis=1), np.asarray(full), rtol=1e-4, atol=1e-4,
                                   err_msg=f"{case} {kind}")


TRANSFORMERS_LOGITS = """
import sys, numpy as np, torch, transformers
ids = torch.tensor(np.load(sys.argv[1]))
for d in sys.argv[2:]:
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        np.save(d + "/logits.npy", model(input_ids=ids).logits.numpy())
"""


def test_a_saved_decoder_is_a_checkpoint_transformers_reads(tmp_path):
    """save_decoder (what favor.tools.random_checkpoint writes) gives directories transformers loads to the
    same logits as favor's model (GPT-2's layout with its fused c_attn; the Llama layout with rescaled
    rotary frequencies; Qwen2's q/k/v biases), and that favor imports to the same parameters."""
    import subprocess
    cases = {"gpt2": dict(preset="gpt2", vocab_size=101, hidden=32, num_layers=2, heads=4, mlp_dim=48, max_positions=40),
             "llama": dict(preset="tiny", vocab_size=101, hidden=32, heads=4, mlp_dim=48, max_positions=64,
                           rotary_base=500.0, rope_scaling="llama3:factor=8,low_freq_factor=1,high_freq_factor=4,"
                                                         "original_max_position_embeddings=16"),
             "qwen2": dict(preset="tiny", vocab_size=101, hidden=32, heads=4, mlp_dim=48, max_positions=64,
                           qkv_bias=True, tie_embeddings=True, rotary_base=1e6)}
    ids = long_inputs()
    np.save(tmp_path / "ids.npy", ids)
    ours = {}
    for name, options in cases.items():
        preset = options.pop("preset")
        model = models.get("decoder", preset, rngs=nnx.Rngs(3), **options)
        for path, var in nnx.iter_graph(model):            # biases drawn: zeros would hide a dropped one
            if isinstance(var, nnx.Param) and path[-1] == "bias":
                var[...] = jax.random.normal(jax.random.key(len(path)), var[...].shape) * 0.5
        models.hf.save_decoder(model, tmp_path / name)
        ours[name] = np.asarray(model(jnp.asarray(ids))["logits"])
        back = models.hf.load(tmp_path / name)
        want, got = nnx.state(model, nnx.Param), nnx.state(back, nnx.Param)
        assert jax.tree.structure(want) == jax.tree.structure(got)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
    done = subprocess.run([sys.executable, "-c", TRANSFORMERS_LOGITS, str(tmp_path / "ids.npy"),
                           *(str(tmp_path / n) for n in cases)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in cases:
        assert np.max(np.abs(np.load(tmp_path / name / "logits.npy") - ours[name])) < TOL, name


def test_random_checkpoint_writes_a_new_directory_only(tmp_path):
    from favor.tools import random_checkpoint
    assert random_checkpoint.main(["tiny", "--out", str(tmp_path / "ckpt"), "--vocab_size", "101"]) == 0
    assert models.hf.load(tmp_path / "ckpt").config["vocab_size"] == 101
    before = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    assert random_checkpoint.main(["tiny", "--out", str(tmp_path / "ckpt"), "--seed", "1"]) == 2
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == before


def with_tokenizer(hf_reference, tmp_path, case):
    """A copy of a tiny decoder checkpoint with a tokenizer.json of its own (a word-level one, trained
    here)."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers
    path = shutil.copytree(hf_reference / case, tmp_path / case)
    words = Tokenizer(tok_models.WordLevel(unk_token="<unk>"))          # ≤ the checkpoint's 101 entries
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(["return the value of the file in a list", "raise an error if the name is not found"] * 5,
                              trainers.WordLevelTrainer(vocab_size=100, special_tokens=["<unk>", "</s>"]))
    words.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("case", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_a_run_from_a_hugging_face_decoder_keeps_its_tokenizer_and_generates(hf_reference, docstrings_cache,
                                                                             tmp_path, capsys, case):
    """The run records the checkpoint's tokenizer.json as it is (favor's record beside it, under another
    name), and generation, a resumed run and a run that starts from this one all encode with it."""
    from favor import job, uptrain
    from favor.data import tokenizers
    from favor.tools import generate
    sys.path.insert(0, str(ROOT))
    from configs import decoder_lm
    path = with_tokenizer(hf_reference, tmp_path, case)
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    config = decoder_lm.get_config(f"runlocal,kind=favor+,init={path}")
    config.total_steps, config.checkpoint_every, config.eval_every, config.log_every = 2, 2, 2, 2
    run = tmp_path / "run"
    job.run(config, run)
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    text = ["return the value of the file", "raise an error if the name is not found"]
    want = tokenizers.get(f"hf:{path}").ids(text)
    assert tokenizers.get(uptrain.recorded_tokenizer(run)).ids(text) == want
    assert generate.main(["--workdir", str(run), "--prompt", "return the value", "--max_tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("return the value")
    # an instruct model's prompt: the chat template the tokenizer brought (here one that adds a space)
    assert generate.main(["--workdir", str(run), "--prompt", "return the", "--max_tokens", "2", "--chat"]) == 0
    assert capsys.readouterr().out.startswith("return the")
    config.total_steps = 3                                   # resumed: the record is kept as it is
    job.run(config, run)
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    follow = decoder_lm.get_config("runlocal,kind=favor+")            # init_from=run: of that run
    follow.model.init_from = f"run:{run}"
    assert tokenizers.get(uptrain.tokenizer_spec(follow, tmp_path / "next")).ids(text) == want


@pytest.mark.parametrize("case", ["LlamaForCausalLM", "llama3", "Qwen2ForCausalLM"])
def test_a_decoder_run_starts_from_a_hugging_face_checkpoint(hf_reference, docstrings_cache, tmp_path, case):
    """configs/decoder_lm.py:init=<dir> takes the checkpoint's sizes, layout, rotary base and scaling and
    q/k/v biases, its weights (init_from=hf:) and its tokenizer.json (a run rebuilt from it holds exactly
    the checkpoint's parameters; training from there is the warm-start loop every init_from shares); a
    run configured by hand with another rotary base or scaling is refused, naming the key and both values
    (the weights would load and the model silently compute otherwise)."""
    from favor import job
    sys.path.insert(0, str(ROOT))
    from configs import decoder_lm
    path = with_tokenizer(hf_reference, tmp_path, case)
    config = decoder_lm.get_config(f"runlocal,kind=favor+,init={path}")
    base, scaling, qkv_bias, _ = DECODER_CASES[case]
    assert (config.model.heads, config.model.vocab_size) == (4, 101)
    assert (config.model.rotary_base, config.model.rope_scaling, config.model.qkv_bias) == (base, scaling, qkv_bias)
    assert config.data.tokenizer == f"hf:{path}" and config.model.init_from == f"hf:{path}"
    job.validate(config)
    state = job.rebuild(config, tmp_path / "rebuilt")[-1]
    want = nnx.to_pure_dict(nnx.state(models.hf.load(path), nnx.Param))
    got = nnx.to_pure_dict(state["params"])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
    for key, value, says in (("rotary_base", 10000.0, rf"in rotary_base \(run 10000.0, checkpoint {base}\)"),
                             ("rope_scaling", "linear:factor=3", r"in rope_scaling \(run 'linear:factor=3', "
                                                                 rf"checkpoint '{scaling}'\)")):
        changed = config.copy_and_resolve_references()
        changed.model[key] = value
        with pytest.raises(ValueError, match=says):
            job.rebuild(changed, tmp_path / "other")
    config.model.rope_scaling = "ntk:factor=2"
    with pytest.raises(loading.ConfigError, match=r"config.model.rope_scaling='ntk:factor=2': .*unknown type 'ntk'"):
        job.validate(config)


def test_llama3_special_tokens_are_read_from_the_tokenizer_config(tmp_path):
    """Llama 3's tokenizer: documents end with the tokenizer config's eos_token (<|end_of_text|> for the
    base models, <|eot_id|> for the Instruct ones, as transformers reads it), begin with its bos_token;
    without a tokenizer_config.json, Llama 3's own names are recognised."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers
    from favor.data import tokenizers
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    words = Tokenizer(tok_models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(["return the value of the file"] * 3,
                              trainers.WordLevelTrainer(special_tokens=["<unk>", *special]))
    words.save(str(tmp_path / "tokenizer.json"))
    ids = {t: words.token_to_id(t) for t in special}
    tok = tokenizers.get(f"hf:{tmp_path}")
    assert (tok.cls_id, tok.sep_id) == (ids["<|begin_of_text|>"], ids["<|end_of_text|>"])
    for eos in ("<|eot_id|>", {"content": "<|eot_id|>", "special": True}):       # the Instruct models' config
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                    "eos_token": eos}))
        tok = tokenizers.get(f"hf:{tmp_path}")
        assert (tok.cls_id, tok.sep_id, tok.pad_id) == (ids["<|begin_of_text|>"], ids["<|eot_id|>"], ids["<|eot_id|>"])
    # the Instruct models' chat template, from the config or from chat_template.jinja, rendered as
    # transformers renders it (written out here by hand)
    template = ("{{- bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
                " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
    want = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nreturn the value<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        tokenizers.get(f"hf:{tmp_path}").chat("return the value")
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert tokenizers.get(f"hf:{tmp_path}").chat(" return the value ") == want
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = tokenizers.get(f"hf:{tmp_path}")
    assert tok.chat("return the value") == want
    assert tok.ids([want])[0][0] == ids["<|begin_of_text|>"]           # the template's specials are tokens
    tok.save(tmp_path / "saved")                                          # and travel with a run
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == template
