"""Hugging Face import: tiny random BERT/ViT models built with transformers (torch CPU) are saved,
imported with favor.models.hf.load, and must give the same hidden states (softmax attention).
transformers has no Flax models; torch is only the reference here, and it runs in a process of its
own (tests/hf_reference.py, the `hf_reference` fixture): these tests read its checkpoints and outputs."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from favor import models
from hf_reference import inputs

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
    (path / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*BertModel"):
        models.hf.load(path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.hf.load(tmp_path / "nowhere")
