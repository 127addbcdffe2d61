"""Import Hugging Face BERT, ViT, GPT-2, Llama (2 and 3.x), Qwen2 and Mistral checkpoints (config.json +
safetensors) into favor models.

    model = favor.models.hf.load("path/to/bert-base-uncased", attention={"kind": "favor++"})

The architecture in config.json picks the favor model and head: BertModel (no head),
BertForMaskedLM ("mlm"), BertForSequenceClassification ("classification", or "regression" for one
label / problem_type "regression"), ViTModel (no head), ViTForImageClassification; GPT2LMHeadModel /
GPT2Model become the decoder in its GPT-2 layout, LlamaForCausalLM / Qwen2ForCausalLM /
MistralForCausalLM (and their *Model bodies) in its Llama layout: Qwen2 with biases on the query, key and
value projections (`qkv_bias`), Llama 3.1's rescaled rotary frequencies as `rope_scaling`
(favor.models.rope). A base model without an LM head gets a fresh, untied one, or the tied embeddings.
`overrides` go on top, e.g. the attention kind to uptrain with, dropout, or a new head for fine-tuning.

Two decoder checkpoints need a rewrite that changes no output: GPT-2's fused c_attn is split into the
query, key and value projections, and grouped-query attention (num_key_value_heads < heads) has each
key/value head's projection (and bias) repeated for the query heads that share it, as the model computes
it. Checkpoints whose computation differs from favor's decoder are refused by name: another activation,
biases elsewhere, a rope scaling whose frequencies follow the length (dynamic NTK) or that scales the
logits (YaRN, LongRoPE), a sliding window shorter than the positions the model takes.

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
from safetensors.numpy import load_file, save_file

from favor.models import rope, zoo
from favor.models.layers import is_feature_map_param, is_qk_norm_param

BERT_ARCHS = {"BertModel": "none", "BertForMaskedLM": "mlm", "BertForSequenceClassification": "classification"}
VIT_ARCHS = {"ViTModel": False, "ViTForImageClassification": True}
# architecture -> family; every family but GPT-2 is the Llama layout (RMSNorm, SwiGLU, rotary positions)
DECODER_ARCHS = {"GPT2LMHeadModel": "gpt2", "GPT2Model": "gpt2", "LlamaForCausalLM": "llama", "LlamaModel": "llama",
                 "Qwen2ForCausalLM": "qwen2", "Qwen2Model": "qwen2", "MistralForCausalLM": "mistral",
                 "MistralModel": "mistral"}
FAMILY_NAMES = {"gpt2": "GPT-2", "llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
HEAD_PARAMS = ("mlm_", "classifier", "head", "lm_head")   # favor parameter paths a fine-tuning head may add


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


def gpt2_names(num_layers):
    """GPT-2's Conv1D weights are stored [in, out], as favor's kernels: no transpose. c_attn arrives split
    (`_split_gpt2_qkv`)."""
    n = {"wte.weight": ("token_embeddings.embedding", None), "wpe.weight": ("position_embeddings.embedding", None),
         "lm_head.weight": ("token_embeddings.embedding", "tied")}
    conv = lambda hf, favor: n.update({f"{hf}.weight": (f"{favor}.kernel", None), f"{hf}.bias": (f"{favor}.bias", None)})
    for i in range(num_layers):
        h, f = f"h.{i}", f"layers.{i}"
        _norm(n, f"{h}.ln_1", f"{f}.attention_norm")
        for p in ("query", "key", "value"):
            conv(f"{h}.attn.{p}", f"{f}.attention.{p}")
        conv(f"{h}.attn.c_proj", f"{f}.attention.out")
        _norm(n, f"{h}.ln_2", f"{f}.mlp_norm")
        conv(f"{h}.mlp.c_fc", f"{f}.mlp.intermediate")
        conv(f"{h}.mlp.c_proj", f"{f}.mlp.output")
    _norm(n, "ln_f", "final_norm")
    return n


def llama_names(num_layers, tied, qkv_bias=False):
    """The Llama layout's names (Qwen2's and Mistral's too; Qwen2 with biases on q/k/v: `qkv_bias`)."""
    n = {"embed_tokens.weight": ("token_embeddings.embedding", None), "norm.weight": ("final_norm.scale", None),
         "lm_head.weight": ("token_embeddings.embedding", "tied") if tied else ("lm_head.kernel", "T")}
    for i in range(num_layers):
        h, f = f"layers.{i}", f"layers.{i}"
        n[f"{h}.input_layernorm.weight"] = (f"{f}.attention_norm.scale", None)
        n[f"{h}.post_attention_layernorm.weight"] = (f"{f}.mlp_norm.scale", None)
        for hp, fp in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("o_proj", "out")):
            n[f"{h}.self_attn.{hp}.weight"] = (f"{f}.attention.{fp}.kernel", "T")
            if qkv_bias and hp != "o_proj":
                n[f"{h}.self_attn.{hp}.bias"] = (f"{f}.attention.{fp}.bias", None)
        for p in ("gate", "up", "down"):
            n[f"{h}.mlp.{p}_proj.weight"] = (f"{f}.mlp.{p}.kernel", "T")
    return n


def _split_gpt2_qkv(tensors, hidden):
    out = {}
    for k, v in tensors.items():
        if ".attn.c_attn." in k:
            for part, piece in zip(("query", "key", "value"), np.split(np.asarray(v), 3, axis=-1)):
                out[k.replace("c_attn", part)] = piece
        elif not k.endswith((".attn.bias", ".attn.masked_bias")):   # old checkpoints' causal-mask buffers
            out[k] = v
    return out


def _repeat_kv_heads(tensors, heads, kv_heads, head_dim):
    """Grouped-query attention as full multi-head attention: query head j reads key/value head
    j // (heads / kv_heads), so each k_proj/v_proj head's rows are repeated that many times."""
    if kv_heads == heads:
        return tensors
    group = heads // kv_heads
    out = dict(tensors)
    for k, v in tensors.items():
        if k.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_proj.bias",
                       "self_attn.v_proj.bias")):
            v = np.asarray(v)        # [kv_heads·head_dim, in] weights, [kv_heads·head_dim] biases
            rows = np.repeat(v.reshape(kv_heads, head_dim, *v.shape[1:]), group, axis=0)
            out[k] = rows.reshape(heads * head_dim, *v.shape[1:])
    return out


def _gpt2_config(cfg, tensors, arch):
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation_function {act!r} is not supported; favor's GPT-2 layout uses "
                         f"'gelu_new' (the tanh approximation)")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if cfg.get(key, ok) != ok:
            raise ValueError(f"GPT-2 {key}={cfg[key]!r} is not supported; favor's decoder needs {key}={ok}")
    h = cfg["n_embd"]
    return dict(vocab_size=cfg["vocab_size"], hidden=h, num_layers=cfg["n_layer"], heads=cfg["n_head"],
                mlp_dim=cfg.get("n_inner") or 4 * h, max_positions=cfg["n_positions"], norm="layer", mlp="gelu",
                positions="learned", tie_embeddings=True, use_bias=True, norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                dropout=cfg.get("resid_pdrop", 0.1), attention_dropout=0.0)


ROPE_REFUSED = ("dynamic NTK's frequencies change with the sequence's length (no state or cache decodes it); "
                "YaRN and LongRoPE also scale the attention logits")


def _rope(cfg, family):
    """(rotary base, favor.models.rope scaling spec) of a config.json. transformers ≥ 5 writes
    rope_parameters (rope_type, rope_theta and the scaling's keys); checkpoints saved before keep
    rope_theta and rope_scaling, with its type as "rope_type" or "type"."""
    name = FAMILY_NAMES[family]
    # a file holds one of the two; where both are, the older key is the one a person set
    scaling = cfg.get("rope_scaling") or {}
    params = {**(cfg.get("rope_parameters") or {}), **scaling}
    base = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type") or scaling.get("type") or params.get("rope_type") or "default"
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"{name} partial_rotary_factor {partial:g} is not supported; favor rotates the whole head")
    if kind == "default":
        return base, ""
    if kind not in rope.PARAMETERS:
        raise ValueError(f"{name} rope scaling {kind!r} is not supported; favor's rotary positions take the default "
                         f"(unscaled) and {', '.join(map(repr, rope.PARAMETERS))} ({ROPE_REFUSED})")
    if kind == "llama3":            # transformers falls back to max_position_embeddings for it
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    missing = [k for k in rope.PARAMETERS[kind] if params.get(k) is None]
    if missing:
        raise ValueError(f"{name} rope scaling {kind!r} lacks {', '.join(missing)} in config.json")
    spec = rope.spec(kind, params)
    rope.parse(spec)                # its values' own checks, naming the spec
    return base, spec


def _sliding_window(cfg, family):
    """Mistral and Qwen2 may attend over a sliding window of the last `sliding_window` tokens; favor's
    softmax decoder attends over the whole prefix, which is the same computation only when no sequence
    the model takes is longer than the window."""
    window = cfg.get("sliding_window")
    if family == "qwen2" and not cfg.get("use_sliding_window", False):
        return
    if window is not None and int(window) < int(cfg["max_position_embeddings"]):
        raise ValueError(f"{FAMILY_NAMES[family]} sliding_window {window} < max_position_embeddings "
                         f"{cfg['max_position_embeddings']} is not supported: favor's decoder attends over the whole "
                         f"prefix, so a sequence longer than the window would compute otherwise (checkpoints whose "
                         f"config.json sets sliding_window to null, or to at least max_position_embeddings, import)")


def _llama_config(cfg, tensors, arch):
    """The Llama layout's options (Llama 2/3.x, Qwen2, Mistral: `arch` picks the family)."""
    family = DECODER_ARCHS[arch]
    name = FAMILY_NAMES[family]
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name} hidden_act {cfg['hidden_act']!r} is not supported; favor's SwiGLU uses 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{name} {key}=True is not supported; favor's Llama layout has no biases there")
    _sliding_window(cfg, family)
    heads, h = cfg["num_attention_heads"], cfg["hidden_size"]
    if (cfg.get("head_dim") or h // heads) * heads != h:
        raise ValueError(f"{name} head_dim {cfg['head_dim']} × {heads} heads ≠ hidden_size {h}: not supported")
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise ValueError(f"{name} num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    base, scaling = _rope(cfg, family)
    return dict(vocab_size=cfg["vocab_size"], hidden=h, num_layers=cfg["num_hidden_layers"], heads=heads,
                mlp_dim=cfg["intermediate_size"], max_positions=cfg["max_position_embeddings"], norm="rms",
                mlp="swiglu", positions="rotary", rotary_base=base, rope_scaling=scaling,
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), use_bias=False,
                qkv_bias=family == "qwen2", norm_eps=cfg.get("rms_norm_eps", 1e-6), dropout=0.0,
                attention_dropout=0.0)


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


def _read_config(path: Path):
    """(config.json as a dict, the architecture favor imports it as)."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in BERT_ARCHS or a in VIT_ARCHS or a in DECODER_ARCHS), None)
    if arch is None:
        raise ValueError(f"{path}: architectures {archs} has none favor imports; "
                         f"valid: {', '.join([*BERT_ARCHS, *VIT_ARCHS, *DECODER_ARCHS])}")
    return cfg, arch


def decoder_config(path) -> dict:
    """The decoder options (favor.config.presets keys) a Hugging Face decoder directory's config.json
    implies: what a run must be configured with to start from it (configs/decoder_lm.py's `init=`)."""
    path = Path(path)
    cfg, arch = _read_config(path)
    if arch not in DECODER_ARCHS:
        raise ValueError(f"{path}: {arch} is not a decoder; valid: {', '.join(DECODER_ARCHS)}")
    return (_gpt2_config if DECODER_ARCHS[arch] == "gpt2" else _llama_config)(cfg, None, arch)


def load(path, *, rngs: nnx.Rngs | None = None, **overrides) -> nnx.Module:
    """Build the favor model matching a Hugging Face directory (any architecture above) and copy its weights in."""
    path = Path(path)
    cfg, arch = _read_config(path)
    tensors = read_tensors(path)
    if arch in DECODER_ARCHS:
        family, layout = "decoder", "gpt2" if DECODER_ARCHS[arch] == "gpt2" else "llama"
        # GPT2LMHeadModel nests the body under transformer., the Llama layout's *ForCausalLM under model.
        tensors = _strip(tensors, "transformer." if layout == "gpt2" else "model.")
        base = (_gpt2_config if layout == "gpt2" else _llama_config)(cfg, tensors, arch)
        if layout == "gpt2":
            tensors = _split_gpt2_qkv(tensors, base["hidden"])
        else:
            tensors = _repeat_kv_heads(tensors, base["heads"], cfg.get("num_key_value_heads") or base["heads"],
                                       base["hidden"] // base["heads"])
    else:
        family = "bert" if arch in BERT_ARCHS else "vit"
        tensors = _strip(tensors, family + ".")     # BertFor*/ViTFor* nest the encoder under bert./vit.
        base = _bert_config(cfg, tensors, arch) if family == "bert" else _vit_config(cfg, tensors, arch)
    model = zoo.get(family, "small" if family == "decoder" else "base", rngs=rngs, **{**base, **overrides})
    layers = model.config["num_layers"]
    if family == "decoder":
        names = gpt2_names(layers) if layout == "gpt2" else llama_names(layers, model.config["tie_embeddings"],
                                                                        model.config["qkv_bias"])
    else:
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
        if how == "tied":         # an output projection that is the token embedding (BERT's MLM decoder, GPT-2's)
            emb = next((tensors[k] for k, (t, h) in names.items() if t == target and h is None and k in tensors), None)
            if emb is None or not np.array_equal(np.asarray(value), np.asarray(emb)):
                raise ValueError(f"{path}: {hf_name} differs from the token embeddings; favor's output layer "
                                 f"is tied to them here (untied output layers are not supported in this layout)")
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
    # new heads, qk_norm's parameters, a learned kind's feature maps and a window's learned mix: no
    # softmax checkpoint has them
    fresh = [p for p in not_filled if p.startswith(HEAD_PARAMS) or is_qk_norm_param(p) or is_feature_map_param(p)]
    absent = [p for p in not_filled if p not in fresh]
    if absent:
        raise ValueError(f"{path}: favor parameters missing from the checkpoint: {', '.join(absent)}")
    if fresh:
        warnings.warn(f"{path}: newly initialised (not in the checkpoint): {', '.join(fresh)}", stacklevel=2)
    return model


def save_decoder(model, path) -> Path:
    """Write a favor decoder as a Hugging Face directory (config.json + model.safetensors) that
    transformers and `load` read: GPT2LMHeadModel for the GPT-2 layout, LlamaForCausalLM for the Llama
    layout (Qwen2ForCausalLM with q/k/v biases), every key/value head its own (no grouping). What
    favor.tools.random_checkpoint writes, so a recipe can be timed at a real model's size offline."""
    c, path = model.config, Path(path)
    gpt2 = c["positions"] == "learned"
    params = {k: np.asarray(v[...], np.float32) for k, v in _params_by_path(model).items()}
    if gpt2:
        names, prefix = gpt2_names(c["num_layers"]), "transformer."
    else:
        names, prefix = llama_names(c["num_layers"], c["tie_embeddings"], c["qkv_bias"]), "model."
    tensors = {}
    for hf_name, (target, how) in names.items():
        if how == "tied" or target not in params:      # a tied output is the embedding, stored once
            continue
        value = params[target].T if how == "T" else params[target]
        tensors[hf_name if hf_name == "lm_head.weight" else prefix + hf_name] = np.ascontiguousarray(value)
    if gpt2:                                            # GPT-2 keeps q, k, v as one Conv1D, [in, 3·out]
        for i in range(c["num_layers"]):
            for part in ("weight", "bias"):
                qkv = [tensors.pop(f"transformer.h.{i}.attn.{p}.{part}") for p in ("query", "key", "value")]
                tensors[f"transformer.h.{i}.attn.c_attn.{part}"] = np.concatenate(qkv, axis=-1)
        cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c["vocab_size"],
               "n_embd": c["hidden"], "n_layer": c["num_layers"], "n_head": c["heads"], "n_inner": c["mlp_dim"],
               "n_positions": c["max_positions"], "activation_function": "gelu_new",
               "layer_norm_epsilon": c["norm_eps"], "tie_word_embeddings": True}
    else:
        arch, kind = ("Qwen2ForCausalLM", "qwen2") if c["qkv_bias"] else ("LlamaForCausalLM", "llama")
        cfg = {"architectures": [arch], "model_type": kind, "vocab_size": c["vocab_size"], "hidden_size": c["hidden"],
               "intermediate_size": c["mlp_dim"], "num_hidden_layers": c["num_layers"],
               "num_attention_heads": c["heads"], "num_key_value_heads": c["heads"],
               "max_position_embeddings": c["max_positions"], "rms_norm_eps": c["norm_eps"],
               "rope_theta": c["rotary_base"], "hidden_act": "silu", "tie_word_embeddings": c["tie_embeddings"]}
        kind_, values = rope.parse(c["rope_scaling"])
        if kind_:
            cfg["rope_scaling"] = {"rope_type": kind_, **values}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


__all__ = ["load", "save_decoder", "decoder_config", "read_tensors", "bert_names", "vit_names", "gpt2_names",
           "llama_names"]
