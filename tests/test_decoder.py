"""The decoder LM: causal outputs, greedy generation equal to the argmax of repeated causal passes for
every kind, a decoding state that does not grow with the prompt for linear kinds, the causal_text data
and the causal_lm task, and a local run trained and sampled by favor.tools.generate."""

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from favor import attention, job, models
from favor.data import text
from favor.tools import generate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import decoder_lm  # noqa: E402

# every kind, the data-dependent HRF, a window hybrid with qk_norm, a learned map with the learned window
# mix, sliding-window softmax, and the GPT-2 layout (learned positions,
# LayerNorm, GELU, biases, tied embeddings)
SPECS = {**{k: ({"kind": k}, {}) for k in attention.names()},
         "hrf-cluster": ({"kind": "hrf", "lambda_": "cluster"}, {}),
         "favor#@3-l2": ({"kind": "favor#", "window": 3, "qk_norm": "l2"}, {}),
         "hedgehog@3-mix": ({"kind": "hedgehog", "window": 3, "window_mix": "learned"}, {}),
         "softmax@3": ({"kind": "softmax", "window": 3}, {}),
         "gpt2-favor+": ({"kind": "favor+"}, {"norm": "layer", "mlp": "gelu", "positions": "learned",
                                              "use_bias": True, "tie_embeddings": True})}
VOCAB = 64


def tiny(spec, **extra):
    block, layout = SPECS[spec]
    block = dict(block)
    if block["kind"] not in ("softmax", "relu", "elu"):
        block.setdefault("num_features", 16)
    if block["kind"] == "hrf":
        block.update(num_features=160, num_lambda_features=4)
    model = models.get("decoder", "tiny", rngs=nnx.Rngs(3), attention=block, vocab_size=VOCAB, hidden=32, heads=2,
                       mlp_dim=64, max_positions=64, **layout, **extra)
    if model.layers[0].attention.fit_stats is not None:
        # data-dependent kinds: running statistics from training batches (as a trained model has them)
        nnx.jit(lambda m, ids: m(ids, deterministic=False))(model, jax.random.randint(jax.random.key(9), (4, 16), 0, VOCAB))
    return model


def forward(model):
    """The model's logits as one jitted program of (ids, mask)."""
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask)["logits"])
    return lambda ids, mask=None: run(state, ids, jnp.ones(ids.shape, bool) if mask is None else mask)


def decoding(model, max_length):
    """(prefill(ids), decode(token, position, caches)) of the model, each as one compiled program; eager,
    each operation compiles on its own."""
    graphdef, state = nnx.split(model)
    prefill = jax.jit(lambda state, ids: nnx.merge(graphdef, state).prefill(ids, max_length=max_length))
    decode = jax.jit(lambda state, token, position, caches: nnx.merge(graphdef, state).decode(token, position, caches))
    return (lambda ids: prefill(state, ids)), (lambda token, position, caches: decode(state, token, position, caches))


@pytest.mark.parametrize("spec", list(SPECS))
def test_greedy_generation_equals_the_argmax_of_repeated_causal_passes(spec):
    """Prefill + token-by-token decoding gives, at every new token, the logits of a causal pass over the
    whole sequence so far (run as one padded program, the valid length growing), and so the same greedy
    tokens."""
    model = tiny(spec)
    prompt = np.asarray(jax.random.randint(jax.random.key(1), (2, 5), 0, VOCAB))
    n = 7
    out, logits = generate.generate(model, prompt, n, return_logits=True)
    assert out.shape == (2, 5 + n) and logits.shape == (2, n, VOCAB) and np.array_equal(out[:, :5], prompt)
    passes = forward(model)
    ids = np.zeros((2, 5 + n), np.int32)
    ids[:, :5] = prompt
    for t in range(n):
        length = 5 + t
        mask = np.broadcast_to(np.arange(5 + n)[None] < length, ids.shape)
        full = np.asarray(passes(jnp.asarray(ids), jnp.asarray(mask)))[:, length - 1]
        # the logits themselves, not just their argmax
        np.testing.assert_allclose(logits[:, t], full, rtol=1e-4, atol=1e-5, err_msg=f"{spec}: token {t}")
        ids[:, length] = full.argmax(-1)
    np.testing.assert_array_equal(out, ids)


@pytest.mark.parametrize("spec", ["favor+", "relu", "favor#", "hrf", "favor#@3-l2", "softmax"])
def test_linear_kinds_decode_from_a_state_that_does_not_grow_with_the_prompt(spec):
    """The cache a prompt leaves has the same shapes at 4 and at 40 prompt tokens for linear kinds (the
    band's w + 1 keys included), so every generated token costs the same memory; softmax's holds every
    position up to the cache's length."""
    graphdef, state = nnx.split(tiny(spec))
    shapes = {}
    for p in (4, 40):
        caches = jax.eval_shape(lambda s, ids: nnx.merge(graphdef, s).prefill(ids, max_length=p + 8)[1], state,
                                jax.ShapeDtypeStruct((1, p), jnp.int32))
        shapes[p] = jax.tree.map(lambda a: a.shape, caches)
    if spec == "softmax":
        assert shapes[4][0]["k"][1] == 12 and shapes[40][0]["k"][1] == 48
    else:
        assert shapes[4] == shapes[40]


def test_future_tokens_never_move_the_past_and_padding_is_invisible():
    for spec in ("favor+", "favor++", "softmax"):
        model = forward(tiny(spec))
        ids = jax.random.randint(jax.random.key(4), (2, 12), 0, VOCAB)
        changed = ids.at[:, 8:].set((ids[:, 8:] + 7) % VOCAB)
        a, b = model(ids), model(changed)
        np.testing.assert_allclose(np.asarray(a[:, :8]), np.asarray(b[:, :8]), rtol=1e-5, atol=1e-6)
        assert not np.allclose(np.asarray(a[:, 8:]), np.asarray(b[:, 8:]))
        mask = jnp.broadcast_to(jnp.arange(12)[None] < 8, ids.shape)
        np.testing.assert_allclose(np.asarray(model(changed, mask)[:, :8]), np.asarray(a[:, :8]),
                                   rtol=1e-5, atol=1e-6)


def test_presets_and_bad_options():
    # GPT-2 small's published size (124,439,808 parameters, as Hugging Face's gpt2 counts them)
    assert models.param_count(nnx.eval_shape(lambda: models.get("decoder", "gpt2"))) == 124_439_808
    assert "decoder" in models.names() and set(models.preset_names("decoder")) >= {"tiny", "small", "gpt2"}
    for key, bad, valid in (("norm", "batch", "rms, layer"), ("mlp", "relu", "swiglu, gelu"),
                            ("positions", "alibi", "rotary, learned")):
        with pytest.raises(ValueError, match=f"unknown {key} {bad!r}; valid: {valid}"):
            models.get("decoder", "tiny", **{key: bad})
    model = tiny("favor+")
    with pytest.raises(ValueError, match="exceeds max_positions 64"):
        model(jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(ValueError, match=r"5 prompt tokens \+ 60 new ones exceed the model's max_positions 64"):
        generate.generate(model, np.zeros((1, 5)), 60)
    with pytest.raises(ValueError, match="length ≥ 1"):
        generate.generate(model, np.zeros((1, 0)), 4)
    with pytest.raises(ValueError, match=f"top_k 65 exceeds the vocabulary of {VOCAB} tokens"):
        generate.generate(model, np.zeros((1, 2)), 4, temperature=1.0, top_k=VOCAB + 1)


@pytest.mark.parametrize("spec", ["favor+", "favor#@3-l2", "softmax"])
def test_decoding_from_an_empty_prompt_equals_the_causal_pass(spec):
    """Decoder.prefill of no tokens leaves the empty state; decoding on from it gives the causal pass's
    logits at every position (the first token sees only itself)."""
    model = tiny(spec)
    prefill, decode = decoding(model, 6)
    ids = jax.random.randint(jax.random.key(5), (2, 6), 0, VOCAB)
    logits, caches = prefill(jnp.zeros((2, 0), jnp.int32))
    assert logits.shape == (2, 0, VOCAB)
    full = np.asarray(forward(model)(ids))
    for t in range(6):
        step, caches = decode(ids[:, t], jnp.asarray(t), caches)
        np.testing.assert_allclose(np.asarray(step), full[:, t], rtol=1e-4, atol=1e-5, err_msg=f"{spec}: {t}")


def test_decoding_past_the_cache_or_the_learned_positions_is_nan_not_a_clamped_answer():
    """A position the cache (softmax) or the position table (learned positions) does not hold cannot be
    refused inside jit (it is traced): its logits are NaN, where the clamped write or lookup would give a
    plausible wrong answer; linear kinds with rotary positions have no such end."""
    ids = jax.random.randint(jax.random.key(6), (1, 4), 0, VOCAB)
    for spec, limit in (("softmax", 4), ("gpt2-favor+", 64)):
        prefill, decode = decoding(tiny(spec), 4)
        _, caches = prefill(ids)
        inside, _ = decode(ids[:, -1], jnp.asarray(limit - 1), caches)
        past, _ = decode(ids[:, -1], jnp.asarray(limit), caches)
        assert np.all(np.isfinite(np.asarray(inside))) and np.all(np.isnan(np.asarray(past))), spec
    prefill, decode = decoding(tiny("favor+"), 4)
    _, caches = prefill(ids)
    assert np.all(np.isfinite(np.asarray(decode(ids[:, -1], jnp.asarray(100), caches)[0])))


def test_sampling_keeps_to_the_top_k_and_greedy_is_the_argmax():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    draws = np.asarray(generate.sample(logits, jax.random.key(0), 1.0, 2))
    assert set(np.unique(draws)) == {0, 1}
    # renormalised over the top 2: P(0) = 0.5 / 0.8, within 5 standard errors
    p = 0.5 / 0.8
    assert abs(np.mean(draws == 0) - p) < 5 * math.sqrt(p * (1 - p) / 4000)
    assert np.all(np.asarray(generate.sample(logits, jax.random.key(0), 0.0, 0)) == 0)
    # a tie at the k-th value: still exactly k candidates (a threshold at the k-th value would keep three)
    tied = jnp.log(jnp.asarray([[0.4, 0.2, 0.2, 0.2]] * 4000))
    assert len(np.unique(np.asarray(generate.sample(tied, jax.random.key(1), 1.0, 2)))) == 2


# -- data, task and a local run ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache(docstrings_cache):
    return docstrings_cache


def test_causal_rows_predict_the_next_token_of_the_stream(cache):
    source = text.CausalText(dataset="local", train_split="train", eval_split="validation", vocab_size=300,
                             tokenizer_sample=1500, max_length=32, max_documents=200, max_eval_rows=8)
    stream = np.asarray(source.tokens["train"])
    n = source.num_train
    assert n == math.ceil((len(stream) - 1) / 32)
    rows = source.read("train", np.arange(n), np.arange(n), None)
    ids, tgt, w, mask = rows["input_ids"], rows["targets"], rows["weights"], rows["attention_mask"]
    # inputs are the stream in order, targets the stream shifted by one: every token but the first is a target once
    np.testing.assert_array_equal(ids[mask > 0], stream[:-1])
    np.testing.assert_array_equal(tgt[w > 0], stream[1:])
    assert np.array_equal(mask > 0, w > 0) and int(w.sum()) == len(stream) - 1


@pytest.fixture(scope="module")
def softmax_run(cache, tmp_path_factory):
    """configs/decoder_lm.py:runlocal with softmax attention, trained once: (workdir, summary)."""
    workdir = tmp_path_factory.mktemp("lm") / "softmax"
    config = decoder_lm.get_config("runlocal,kind=softmax")
    return workdir, job.run(config, workdir)


def test_local_run_trains_and_generates(softmax_run, capsys):
    """configs/decoder_lm.py:runlocal through job.run (the loss falls, perplexity reported), then
    favor.tools.generate on the run: greedy output continues the prompt, deterministic; an empty prompt
    is a clear error."""
    workdir, summary = softmax_run
    losses = [loss for _, loss in summary["train_loss_history"]]
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.3
    assert summary["perplexity"] == pytest.approx(math.exp(summary["loss"]), rel=1e-6)
    args = ["--workdir", str(workdir), "--prompt", "Return the", "--max_tokens", "12", "--keep_going"]
    assert generate.main(args) == 0
    first = capsys.readouterr().out.strip()
    assert generate.main(args) == 0
    assert first.startswith("Return the") and capsys.readouterr().out.strip() == first
    assert generate.main(args + ["--temperature", "0.9", "--top_k", "20", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("Return the")
    assert generate.main(["--workdir", str(workdir), "--prompt", ""]) == 2
    assert "encodes to no tokens" in capsys.readouterr().err


def test_a_decoder_started_from_softmax_calibrates_its_running_statistics(softmax_run, tmp_path):
    """A softmax source keeps no fit statistics: a causal FAVOR++ started from it takes them from its first
    training batch (count > 0 in every layer), so its day-0 evaluation is FAVOR++'s and not the
    data-independent FAVOR+ it would fall back to on empty statistics."""
    from functools import partial
    from favor.train import steps
    day0 = {}
    for kind in ("favor+", "favor++"):
        config = decoder_lm.get_config("runlocal")
        config.model.attention.kind, config.model.init_from = kind, f"run:{softmax_run[0]}"
        config, source, task, model, layout, state = job.rebuild(config, tmp_path / kind)
        counts = [np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state["rest"])[0]
                  if "fit_stats" in jax.tree_util.keystr(path) and "count" in jax.tree_util.keystr(path)]
        assert (len(counts) == 1 and np.all(counts[0] > 0)) if kind == "favor++" else not counts
        step_fn = jax.jit(partial(steps.eval_step, graphdef=model.graphdef, task=task))
        batches = (layout.global_batch(b) for b in source.eval_batches(int(config.eval_batch_size)))
        day0[kind] = steps.evaluate(state, batches, step_fn=step_fn,
                                    finalize=task.finalize)["loss"]
    assert day0["favor++"] != day0["favor+"]


def test_a_hugging_face_tokenizer_json_packs_causal_text(cache, tmp_path):
    """"hf:<dir>": a byte-level BPE tokenizer.json (GPT-2's kind, trained here on a few lines) encodes and
    decodes text, ends documents with its end-of-text token, travels by save/get, feeds causal_text; and
    masked-LM data refuses it (no [MASK])."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from favor.data import tokenizers as favor_tokenizers
    bpe = Tokenizer(tok_models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    lines = ["Return the sum of the values.", "Open a file and return a stream.", "Raise an error if it fails."] * 20
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "gpt").mkdir()
    bpe.save(str(tmp_path / "gpt" / "tokenizer.json"))
    tok = favor_tokenizers.get(f"hf:{tmp_path / 'gpt'}")
    assert tok.sep_id == tok.cls_id == tok.pad_id == bpe.token_to_id("<|endoftext|>") and tok.mask_id is None
    ids = tok.ids(["Return the stream."])[0]
    assert tok.decode(ids) == "Return the stream." and tok.sep_id not in ids
    spec = tok.save(tmp_path / "saved")
    again = favor_tokenizers.get(f"hf:{tmp_path / 'saved' / spec.partition(':')[2]}")
    assert again.ids(["Return the stream."])[0] == ids
    source = text.CausalText(dataset="local", train_split="train", eval_split="validation", tokenizer=f"hf:{tmp_path / 'gpt'}",
                             max_length=32, max_documents=50, max_eval_rows=4)
    stream = np.asarray(source.tokens["train"])
    assert source.vocab_size == bpe.get_vocab_size() and np.sum(stream == tok.sep_id) == 50
    with pytest.raises(ValueError, match="needs a tokenizer with a \\[MASK\\] token"):
        text.MaskedText(dataset="local", train_split="train", eval_split="validation", tokenizer=f"hf:{tmp_path / 'gpt'}",
                        max_length=32, max_documents=50)
    with pytest.raises(FileNotFoundError, match="tokenizer.json does not exist"):
        favor_tokenizers.get(f"hf:{tmp_path}")
