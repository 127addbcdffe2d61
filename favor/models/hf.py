"""Import Hugging Face BERT and ViT checkpoints (config.json + safetensors) into favor models.

    model = favor.models.hf.load("path/to/bert-base-uncased", attention={"kind": "favor++"})

The architecture in config.json picks the favor model and head: BertModel (no head),
BertForMaskedLM ("mlm"), BertForSequenceClassification ("classification", or "regression" for one
label / problem_type "regression"), ViTModel (no head), ViTForImageClassification. `overrides` go
on top, e.g. the attention kind to uptrain with, dropout, or a new head for fine-tuning.

Every checkpoint tensor must land on a favor parameter of the same shape, and every favor parameter
must come from the checkpoint; both kinds of mismatch are errors that name the tensors. The one
exception is a task head the checkpoint does not have (say a classifier on top of BertForMaskedLM):
it keeps its fresh initialisation and a warning names it, as fine-tuning expects.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from favor.models import zoo
from favor.models.layers import is_qk_norm_param

BERT_ARCHS = {"BertModel": "none", "BertForMaskedLM": "mlm", "BertForSequenceClassification": "classification"}
VIT_ARCHS = {"ViTModel": False, "ViTForImageClassification": True}
HEAD_PARAMS = ("mlm_", "classifier", "head")   # favor parameter paths a fine-tuning head may add


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""

    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json "
                                f"(save the Hugging Face model with save_pretrained(..., safe_serialization=True))")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _strip(tensors, prefix):
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tensors.items()}


def _linear(names, hf, favor):
    names[f"{hf}.weight"] = (f"{favor}.kernel", "T")
    names[f"{hf}.bias"] = (f"{favor}.bias", None)


def _norm(names, hf, favor):
    for w, b in (("weight", "bias"), ("gamma", "beta")):   # old TF-converted checkpoints say gamma/beta
        names[f"{hf}.{w}"] = (f"{favor}.scale", None)
        names[f"{hf}.{b}"] = (f"{favor}.bias", None)


def bert_names(num_layers):
    """HF tensor name -> (favor parameter path, transform)."""
    n = {}
    for part in ("word", "position", "token_type"):
        n[f"embeddings.{part}_embeddings.weight"] = (f"{part}_embeddings.embedding", None)
    _norm(n, "embeddings.LayerNorm", "embedding_norm")
    for i in range(num_layers):
        h, f = f"encoder.layer.{i}", f"layers.{i}"
        for p in ("query", "key", "value"):
            _linear(n, f"{h}.attention.self.{p}", f"{f}.attention.{p}")
        _linear(n, f"{h}.attention.output.dense", f"{f}.attention.out")
        _norm(n, f"{h}.attention.output.LayerNorm", f"{f}.attention_norm")
        _linear(n, f"{h}.intermediate.dense", f"{f}.mlp.intermediate")
        _linear(n, f"{h}.output.dense", f"{f}.mlp.output")
        _norm(n, f"{h}.output.LayerNorm", f"{f}.output_norm")
    _linear(n, "pooler.dense", "pooler")
    _linear(n, "cls.predictions.transform.dense", "mlm_transform")
    _norm(n, "cls.predictions.transform.LayerNorm", "mlm_norm")
    n["cls.predictions.bias"] = ("mlm_bias", None)
    n["cls.predictions.decoder.bias"] = ("mlm_bias", None)
    n["cls.predictions.decoder.weight"] = ("word_embeddings.embedding", "tied")
    _linear(n, "classifier", "classifier")
    return n


def vit_names(num_layers):
    n = {"embeddings.cls_token": ("cls_token", None),
         "embeddings.position_embeddings": ("position_embeddings", None),
         "embeddings.patch_embeddings.projection.weight": ("patch_embedding.kernel", "conv"),
         "embeddings.patch_embeddings.projection.bias": ("patch_embedding.bias", None)}
    for i in range(num_layers):
        h, f = f"encoder.layer.{i}", f"layers.{i}"
        _norm(n, f"{h}.layernorm_before", f"{f}.norm_before")
        for p in ("query", "key", "value"):
            _linear(n, f"{h}.attention.attention.{p}", f"{f}.attention.{p}")
        _linear(n, f"{h}.attention.output.dense", f"{f}.attention.out")
        _norm(n, f"{h}.layernorm_after", f"{f}.norm_after")
        _linear(n, f"{h}.intermediate.dense", f"{f}.mlp.intermediate")
        _linear(n, f"{h}.output.dense", f"{f}.mlp.output")
    _norm(n, "layernorm", "norm")
    _linear(n, "pooler.dense", "pooler")
    _linear(n, "classifier", "head")
    return n


def _num_labels(cfg):
    """config.json keeps the label count as id2label (transformers ≥ 5) or num_labels (older)."""
    return cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2


def _bert_config(cfg, tensors, arch):
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"BERT hidden_act {cfg['hidden_act']!r} is not supported; favor's BERT uses 'gelu' (erf)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"BERT position_embedding_type {cfg['position_embedding_type']!r} is not supported; "
                         f"valid: 'absolute'")
    head = BERT_ARCHS[arch]
    num_labels = _num_labels(cfg)
    if head == "classification" and (cfg.get("problem_type") == "regression" or num_labels == 1):
        head = "regression"
    return dict(vocab_size=cfg["vocab_size"], hidden=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
                heads=cfg["num_attention_heads"], mlp_dim=cfg["intermediate_size"],
                max_positions=cfg["max_position_embeddings"], type_vocab_size=cfg["type_vocab_size"],
                dropout=cfg.get("hidden_dropout_prob", 0.1),
                attention_dropout=cfg.get("attention_probs_dropout_prob", 0.1),
                layer_norm_eps=cfg.get("layer_norm_eps", 1e-12), head=head, num_labels=num_labels,
                pooler="pooler.dense.weight" in tensors)


def _vit_config(cfg, tensors, arch):
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"ViT hidden_act {cfg['hidden_act']!r} is not supported; favor's ViT uses 'gelu' (erf)")
    if not cfg.get("qkv_bias", True):
        raise ValueError("ViT checkpoints without qkv biases (qkv_bias=False) are not supported")
    num_classes = 0
    if VIT_ARCHS[arch]:
        num_classes = _num_labels(cfg)
    return dict(image_size=cfg["image_size"], patch_size=cfg["patch_size"], channels=cfg.get("num_channels", 3),
                hidden=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
                mlp_dim=cfg["intermediate_size"], num_classes=num_classes, pool="cls",
                pooler="pooler.dense.weight" in tensors, dropout=cfg.get("hidden_dropout_prob", 0.0),
                attention_dropout=cfg.get("attention_probs_dropout_prob", 0.0),
                layer_norm_eps=cfg.get("layer_norm_eps", 1e-12))


def _params_by_path(model):
    out = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            out[".".join(map(str, path))] = var
    return out


def _convert(value, how):
    if how == "T":
        return value.T
    if how == "conv":            # torch Conv2d [out, in, kh, kw] -> flax [kh, kw, in, out]
        return np.transpose(value, (2, 3, 1, 0))
    return value


def load(path, *, rngs: nnx.Rngs | None = None, **overrides) -> nnx.Module:
    """Build the favor model matching a Hugging Face BERT/ViT directory and copy its weights in."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in BERT_ARCHS or a in VIT_ARCHS), None)
    if arch is None:
        raise ValueError(f"{path}: architectures {archs} has none favor imports; "
                         f"valid: {', '.join([*BERT_ARCHS, *VIT_ARCHS])}")
    tensors = read_tensors(path)
    family = "bert" if arch in BERT_ARCHS else "vit"
    tensors = _strip(tensors, family + ".")     # BertFor*/ViTFor* nest the encoder under bert./vit.
    base = _bert_config(cfg, tensors, arch) if family == "bert" else _vit_config(cfg, tensors, arch)
    model = zoo.get(family, "base", rngs=rngs, **{**base, **overrides})
    layers = model.config["num_layers"]
    names = bert_names(layers) if family == "bert" else vit_names(layers)
    params = _params_by_path(model)

    unknown = sorted(k for k in tensors if k not in names and not k.endswith("position_ids"))
    if unknown:
        raise ValueError(f"{path}: checkpoint tensors with no favor parameter: {', '.join(unknown)}")
    filled, missing_target = set(), []
    for hf_name, value in tensors.items():
        if hf_name.endswith("position_ids"):       # a buffer (0..L-1), not a weight
            continue
        target, how = names[hf_name]
        if how == "tied":                           # the MLM decoder is the word embedding, transposed
            emb = tensors.get("embeddings.word_embeddings.weight")
            if emb is None or not np.array_equal(np.asarray(value), np.asarray(emb)):
                raise ValueError(f"{path}: {hf_name} differs from the word embeddings; favor's MLM head "
                                 f"is tied to them (untied decoders are not supported)")
            continue
        if target not in params:
            missing_target.append(f"{hf_name} -> {target}")
            continue
        var = params[target]
        value = _convert(np.asarray(value), how)
        if tuple(value.shape) != tuple(var[...].shape):
            raise ValueError(f"{path}: {hf_name} has shape {tuple(value.shape)} but favor's {target} is "
                             f"{tuple(var[...].shape)} (check the overrides against config.json)")
        var[...] = jnp.asarray(value, var[...].dtype)
        filled.add(target)
    if missing_target:
        raise ValueError(f"{path}: checkpoint tensors whose favor parameter this model does not have "
                         f"(head or pooler mismatch?): {', '.join(missing_target)}")
    not_filled = sorted(set(params) - filled)
    fresh = [p for p in not_filled if p.startswith(HEAD_PARAMS) or is_qk_norm_param(p)]
    absent = [p for p in not_filled if p not in fresh]
    if absent:
        raise ValueError(f"{path}: favor parameters missing from the checkpoint: {', '.join(absent)}")
    if fresh:
        warnings.warn(f"{path}: newly initialised (not in the checkpoint): {', '.join(fresh)}", stacklevel=2)
    return model


__all__ = ["load", "read_tensors", "bert_names", "vit_names"]
