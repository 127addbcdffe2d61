"""BERT (Devlin et al. 2019) in Flax NNX with any attention kind: embeddings, post-LayerNorm encoder,
pooler, and the masked-LM, classification and regression heads.

    model(input_ids [B, L], token_type_ids=None, attention_mask=None, deterministic=True,
          mlm_positions=None) ->
        {"hidden_states": [B, L, hidden], "pooled": [B, hidden] (with a pooler),
         "logits": [B, L, vocab] (mlm) | [B, num_labels] (classification) | [B] (regression)}

With `mlm_positions` [B, P] the MLM head runs only at those positions (logits [B, P, vocab]), as BERT
pretraining does: the vocabulary projection is the largest matmul of a small model, and only the
~15 % masked positions have a target.

Parameter names follow the Hugging Face layout closely so `favor.models.hf` maps them one to one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from favor.attention import sequence

from favor.models.layers import Mlp, SelfAttention, dense, layer_norm, meta

HEADS = ("mlm", "classification", "regression", "none")
# what the pooler reads: the first token ([CLS], BERT's) or the mean of the valid tokens (with no layers,
# a bag of tokens: the baseline of a task without attention's mixing)
POOLS = ("cls", "mean")


def _normal(std):
    return nnx.initializers.normal(std)


class BertLayer(nnx.Module):
    """Post-LayerNorm block: h = LN(x + attn(x)); out = LN(h + mlp(h))."""

    def __init__(self, c, *, rngs):
        kw = dict(dtype=c["dtype"], param_dtype=c["param_dtype"])
        self.attention = SelfAttention(c["hidden"], c["heads"], c["attention"], rngs=rngs,
                                       dropout=c["attention_dropout"], **kw)
        self.attention_norm = layer_norm(c["hidden"], c["layer_norm_eps"], rngs=rngs,
                                         param_dtype=c["param_dtype"])
        self.mlp = Mlp(c["hidden"], c["mlp_dim"], rngs=rngs, dropout=c["dropout"], **kw)
        self.output_norm = layer_norm(c["hidden"], c["layer_norm_eps"], rngs=rngs,
                                      param_dtype=c["param_dtype"])
        self.dropout = nnx.Dropout(c["dropout"], rngs=rngs)

    def __call__(self, x, mask, deterministic, segment_ids=None):
        a = self.dropout(self.attention(x, mask, deterministic=deterministic, segment_ids=segment_ids),
                         deterministic=deterministic)
        h = self.attention_norm(x + a).astype(x.dtype)
        return self.output_norm(h + self.mlp(h, deterministic=deterministic)).astype(x.dtype)


class Bert(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, **c):
        if c["head"] not in HEADS:
            raise ValueError(f"bert: unknown head {c['head']!r}; valid: {', '.join(HEADS)}")
        if c["pool"] not in POOLS:
            raise ValueError(f"bert: unknown pool {c['pool']!r}; valid: {', '.join(POOLS)}")
        self.config = dict(c)
        h, dt, pdt = c["hidden"], c["dtype"], c["param_dtype"]
        emb = lambda n, axes: nnx.Embed(n, h, dtype=dt, param_dtype=pdt, embedding_init=_normal(0.02),
                                        embedding_metadata=meta(*axes), rngs=rngs)
        self.word_embeddings = emb(c["vocab_size"], ("vocab", "embed"))
        self.position_embeddings = emb(c["max_positions"], (None, "embed"))
        self.token_type_embeddings = emb(c["type_vocab_size"], (None, "embed"))
        self.embedding_norm = layer_norm(h, c["layer_norm_eps"], rngs=rngs, param_dtype=pdt)
        self.embedding_dropout = nnx.Dropout(c["dropout"], rngs=rngs)
        self.layers = nnx.List([BertLayer(c, rngs=rngs) for _ in range(c["num_layers"])])
        kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt, kernel_init=_normal(0.02))
        self.pooler = dense(h, h, ("embed", None), **kw) if c["pooler"] else None
        if c["head"] == "mlm":
            self.mlm_transform = dense(h, h, ("embed", None), **kw)
            self.mlm_norm = layer_norm(h, c["layer_norm_eps"], rngs=rngs, param_dtype=pdt)
            self.mlm_bias = nnx.Param(jnp.zeros((c["vocab_size"],), pdt), **meta("vocab"))
        elif c["head"] in ("classification", "regression"):
            if not c["pooler"]:
                raise ValueError(f"bert: the {c['head']} head reads the pooled output; set pooler=True")
            n = c["num_labels"] if c["head"] == "classification" else 1
            self.classifier_dropout = nnx.Dropout(c["dropout"], rngs=rngs)
            self.classifier = dense(h, n, ("embed", "classes"), **kw)

    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, deterministic: bool = True,
                 mlm_positions=None, segment_ids=None, positions=None):
        """Packed documents: segment_ids [B, L] (a token attends only to its own document) and positions
        [B, L] (each document's from 0; default 0 … L − 1), as favor.data.text's documents packing gives."""
        c = self.config
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"bert: input_ids must be [batch, length]; got shape {input_ids.shape}")
        b, l = input_ids.shape
        if l > c["max_positions"]:
            raise ValueError(f"bert: sequence length {l} exceeds max_positions {c['max_positions']}")
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        mask = None if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
        if positions is None:
            positions = jnp.arange(l)[None]
        elif tuple(jnp.shape(positions)) != (b, l):
            raise ValueError(f"bert: positions gives each token's position in its document, [B, L] = {(b, l)}; "
                             f"got shape {tuple(jnp.shape(positions))}")
        x = (self.word_embeddings(input_ids) + self.position_embeddings(jnp.asarray(positions, jnp.int32))
             + self.token_type_embeddings(token_type_ids))
        x = self.embedding_norm(x).astype(x.dtype)
        x = self.embedding_dropout(x, deterministic=deterministic)
        x = sequence.constrain(x)      # split along L where the mesh has a sequence axis
        for layer in self.layers:
            x = layer(x, mask, deterministic, segment_ids)
        out = {"hidden_states": x}
        if self.pooler is not None:
            if c["pool"] == "mean":
                w = (jnp.ones((b, l), x.dtype) if mask is None else mask.astype(x.dtype))[..., None]
                first = jnp.sum(x * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
            else:
                first = x[:, 0]
            out["pooled"] = jnp.tanh(self.pooler(first))
        if c["head"] == "mlm":
            if mlm_positions is not None:
                x = jnp.take_along_axis(x, jnp.asarray(mlm_positions)[..., None], axis=1)
            t = self.mlm_norm(jax.nn.gelu(self.mlm_transform(x), approximate=False)).astype(x.dtype)
            out["logits"] = (self.word_embeddings.attend(t).astype(jnp.float32)
                             + self.mlm_bias[...].astype(jnp.float32))
        elif c["head"] in ("classification", "regression"):
            logits = self.classifier(self.classifier_dropout(out["pooled"], deterministic=deterministic))
            logits = logits.astype(jnp.float32)
            out["logits"] = logits[:, 0] if c["head"] == "regression" else logits
        return out
