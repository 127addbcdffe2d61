"""Hugging Face import: tiny random BERT/ViT models built with transformers (torch CPU) are saved,
imported with favor.models.hf.load, and must give the same hidden states (softmax attention).
transformers has no Flax models; torch is only the reference here."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel, ViTConfig,
                          ViTForImageClassification, ViTModel)

from flax import nnx

from favor import models

TOL = 1e-4

BERT = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=40, type_vocab_size=2)
VIT = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=48)


def save(model, path):
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def bert_inputs():
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 101, (3, 14))
    types = rng.randint(0, 2, (3, 14))
    mask = np.ones((3, 14), np.int64)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    return ids, types, mask


def run_hf_bert(model, ids, types, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                     attention_mask=torch.tensor(mask), output_hidden_states=True)


@pytest.mark.parametrize("cls", [BertModel, BertForMaskedLM, BertForSequenceClassification])
def test_bert_matches_hugging_face(tmp_path, cls):
    torch.manual_seed(0)
    ref_model = cls(BertConfig(**BERT, num_labels=3))
    path = save(ref_model, tmp_path / cls.__name__)
    ids, types, mask = bert_inputs()
    ref = run_hf_bert(ref_model, ids, types, mask)
    ours = models.hf.load(path)(jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask))
    valid = mask.astype(bool)
    ref_hidden = ref.hidden_states[-1].numpy() if cls is not BertModel else ref.last_hidden_state.numpy()
    assert np.max(np.abs(np.asarray(ours["hidden_states"]) - ref_hidden)[valid]) < TOL
    if cls is BertModel:
        np.testing.assert_allclose(np.asarray(ours["pooled"]), ref.pooler_output.numpy(), atol=TOL)
    elif cls is BertForMaskedLM:
        assert np.max(np.abs(np.asarray(ours["logits"]) - ref.logits.numpy())[valid]) < TOL
    else:
        np.testing.assert_allclose(np.asarray(ours["logits"]), ref.logits.numpy(), atol=TOL)


def test_bert_regression_head(tmp_path):
    torch.manual_seed(1)
    ref_model = BertForSequenceClassification(BertConfig(**BERT, num_labels=1))
    path = save(ref_model, tmp_path / "stsb")
    ids, types, mask = bert_inputs()
    ref = run_hf_bert(ref_model, ids, types, mask)
    model = models.hf.load(path)
    assert model.config["head"] == "regression"
    out = model(jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(out["logits"]), ref.logits.numpy()[:, 0], atol=TOL)


@pytest.mark.parametrize("cls", [ViTModel, ViTForImageClassification])
def test_vit_matches_hugging_face(tmp_path, cls):
    torch.manual_seed(0)
    ref_model = cls(ViTConfig(**VIT, num_labels=5))
    path = save(ref_model, tmp_path / cls.__name__)
    images = np.random.RandomState(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
    with torch.no_grad():
        ref = ref_model(pixel_values=torch.tensor(images.transpose(0, 3, 1, 2)), output_hidden_states=True)
    ours = models.hf.load(path)(jnp.asarray(images))
    if cls is ViTModel:
        np.testing.assert_allclose(np.asarray(ours["hidden_states"]), ref.last_hidden_state.numpy(), atol=TOL)
        np.testing.assert_allclose(np.asarray(ours["pooler_output"]), ref.pooler_output.numpy(), atol=TOL)
    else:
        np.testing.assert_allclose(np.asarray(ours["logits"]), ref.logits.numpy(), atol=TOL)


def test_uptraining_import_keeps_the_parameter_tree(tmp_path):
    torch.manual_seed(0)
    path = save(BertForMaskedLM(BertConfig(**BERT)), tmp_path / "mlm")
    soft = models.hf.load(path)
    fav = models.hf.load(path, attention={"kind": "favor++", "num_features": 512})
    tree = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Param))
    a, b = tree(soft), tree(fav)
    assert jnp.array_equal(a["word_embeddings"]["embedding"], b["word_embeddings"]["embedding"])
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    ids, types, mask = bert_inputs()
    out_s = soft(jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask))["hidden_states"]
    out_f = fav(jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask))["hidden_states"]
    valid = mask.astype(bool)
    # FAVOR++ with many features approximates the imported softmax model (not exactly)
    err = np.abs(np.asarray(out_f) - np.asarray(out_s))[valid]
    assert np.all(np.isfinite(err)) and 0 < err.mean() < 0.1


def test_fine_tuning_head_is_fresh_and_named(tmp_path):
    torch.manual_seed(0)
    path = save(BertModel(BertConfig(**BERT)), tmp_path / "encoder")
    with pytest.warns(UserWarning, match="newly initialised.*classifier"):
        model = models.hf.load(path, head="classification", num_labels=4)
    assert model(jnp.asarray(bert_inputs()[0]))["logits"].shape == (3, 4)


def test_unknown_or_missing_tensors_are_named(tmp_path):
    torch.manual_seed(0)
    path = save(BertModel(BertConfig(**BERT)), tmp_path / "bert")
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

