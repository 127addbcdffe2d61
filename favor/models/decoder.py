"""A decoder-only language model in Flax NNX with any attention kind, causal: the Llama layout (pre-norm
RMSNorm, SwiGLU, rotary positions, no biases) and the GPT-2 one (pre-norm LayerNorm, GELU MLP, learned
positions, biases, tied embeddings), chosen by options.

    model(input_ids [B, L], attention_mask=None, deterministic=True) ->
        {"logits": [B, L, vocab] float32, "hidden_states": [B, L, hidden]}

Generation (favor.generate) runs a prompt through `prefill` (the causal pass, which also leaves each
layer's cache) and then `decode` one token at a time: linear kinds carry a state whose size does not
grow with the sequence (the running feature sums, and the band's last w + 1 keys for a window hybrid);
softmax keeps every key and value up to `max_length`.

Data-dependent kinds (favor++, favor#, hrf-cluster, importance sampling) fit their features to running
statistics each layer keeps (layers.FitStatistics), never to the sequence itself, which would read the
future.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from favor.attention import sequence

from favor.models.layers import Mlp, SelfAttention, dense, layer_norm, meta

NORMS = ("rms", "layer")
MLPS = ("swiglu", "gelu")
POSITIONS = ("rotary", "learned")


def _norm(c, rngs):
    if c["norm"] == "rms":
        return nnx.RMSNorm(c["hidden"], epsilon=c["norm_eps"], dtype=jnp.float32, param_dtype=c["param_dtype"],
                           rngs=rngs, scale_metadata=meta("embed"))
    return layer_norm(c["hidden"], c["norm_eps"], rngs=rngs, param_dtype=c["param_dtype"])


class SwiGlu(nnx.Module):
    """hidden -> down(silu(gate(x)) · up(x)) (Shazeer 2020; Llama's MLP)."""

    def __init__(self, hidden, mlp, *, rngs, use_bias=False, dropout=0.0, dtype=None, param_dtype=jnp.float32):
        proj = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias)
        self.gate = dense(hidden, mlp, ("embed", "mlp"), **proj)
        self.up = dense(hidden, mlp, ("embed", "mlp"), **proj)
        self.down = dense(mlp, hidden, ("mlp", "embed"), **proj)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x, *, deterministic: bool = True):
        return self.dropout(self.down(jax.nn.silu(self.gate(x)) * self.up(x)), deterministic=deterministic)


def _positions(positions, input_ids):
    """[B, L] int32 positions (None: 0 … L − 1 for every row), a wrong shape a ValueError naming it."""
    b, l = input_ids.shape
    if positions is None:
        return jnp.arange(l)[None]
    if tuple(jnp.shape(positions)) != (b, l):
        raise ValueError(f"positions gives each token's position in its document, [B, L] = {(b, l)}; "
                         f"got shape {tuple(jnp.shape(positions))}")
    return jnp.asarray(positions, jnp.int32)


class DecoderLayer(nnx.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h))."""

    def __init__(self, c, *, rngs):
        kw = dict(dtype=c["dtype"], param_dtype=c["param_dtype"])
        self.attention_norm = _norm(c, rngs)
        self.attention = SelfAttention(c["hidden"], c["heads"], c["attention"], rngs=rngs, causal=True,
                                       dropout=c["attention_dropout"], use_rotary=c["positions"] == "rotary",
                                       rotary_base=c["rotary_base"], rope_scaling=c["rope_scaling"],
                                       use_bias=c["use_bias"], qkv_bias=c["qkv_bias"], **kw)
        self.mlp_norm = _norm(c, rngs)
        if c["mlp"] == "swiglu":
            self.mlp = SwiGlu(c["hidden"], c["mlp_dim"], rngs=rngs, use_bias=c["use_bias"], dropout=c["dropout"], **kw)
        else:   # GPT-2's "gelu_new", the tanh approximation
            self.mlp = Mlp(c["hidden"], c["mlp_dim"], rngs=rngs, dropout=c["dropout"],
                           activation=lambda u: jax.nn.gelu(u, approximate=True), **kw)
        self.dropout = nnx.Dropout(c["dropout"], rngs=rngs)

    def _mlp(self, h, deterministic):
        return h + self.mlp(self.mlp_norm(h).astype(h.dtype), deterministic=deterministic)

    def __call__(self, x, mask, deterministic, positions=None, segment_ids=None):
        a = self.attention(self.attention_norm(x).astype(x.dtype), mask, deterministic=deterministic,
                           positions=positions, segment_ids=segment_ids)
        return self._mlp(x + self.dropout(a, deterministic=deterministic), deterministic)

    def prefill(self, x, max_length):
        a, cache = self.attention.prefill(self.attention_norm(x).astype(x.dtype), max_length)
        return self._mlp(x + a, True), cache

    def decode(self, x, position, cache):
        a, cache = self.attention.decode(self.attention_norm(x).astype(x.dtype), position, cache)
        return self._mlp(x + a, True), cache


class Decoder(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, **c):
        for key, allowed in (("norm", NORMS), ("mlp", MLPS), ("positions", POSITIONS)):
            if c[key] not in allowed:
                raise ValueError(f"decoder: unknown {key} {c[key]!r}; valid: {', '.join(allowed)}")
        self.config = dict(c)
        h, dt, pdt = c["hidden"], c["dtype"], c["param_dtype"]
        emb = lambda n, axes: nnx.Embed(n, h, dtype=dt, param_dtype=pdt, embedding_init=nnx.initializers.normal(0.02),
                                        embedding_metadata=meta(*axes), rngs=rngs)
        self.token_embeddings = emb(c["vocab_size"], ("vocab", "embed"))
        self.position_embeddings = emb(c["max_positions"], (None, "embed")) if c["positions"] == "learned" else None
        self.embedding_dropout = nnx.Dropout(c["dropout"], rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, rngs=rngs) for _ in range(c["num_layers"])])
        self.final_norm = _norm(c, rngs)
        self.lm_head = None if c["tie_embeddings"] else dense(
            h, c["vocab_size"], ("embed", "vocab"), rngs=rngs, dtype=dt, param_dtype=pdt, use_bias=False,
            kernel_init=nnx.initializers.normal(0.02))

    def _embed(self, input_ids, positions):
        x = self.token_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions)
        return x

    def _logits(self, x):
        x = self.final_norm(x).astype(x.dtype)
        logits = self.token_embeddings.attend(x) if self.lm_head is None else self.lm_head(x)
        return x, logits.astype(jnp.float32)

    def _check(self, input_ids):
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"decoder: input_ids must be [batch, length]; got shape {input_ids.shape}")
        if input_ids.shape[1] > self.config["max_positions"]:
            raise ValueError(f"decoder: sequence length {input_ids.shape[1]} exceeds max_positions "
                             f"{self.config['max_positions']}")
        return input_ids

    def __call__(self, input_ids, attention_mask=None, deterministic: bool = True, segment_ids=None,
                 positions=None):
        """attention_mask [B, L] (True = token): padding (at the end of a row) is neither attended to nor
        counted in any statistic. Packed documents: segment_ids [B, L] (a token attends only to its own
        document) and positions [B, L] (each document's from 0; default 0 … L − 1), as
        favor.data.text's documents packing gives them."""
        input_ids = self._check(input_ids)
        mask = None if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
        given = None if positions is None else _positions(positions, input_ids)
        x = self.embedding_dropout(self._embed(input_ids, _positions(positions, input_ids)),
                                   deterministic=deterministic)
        x = sequence.constrain(x)      # split along L where the mesh has a sequence axis
        for layer in self.layers:     # rotary layers read the positions (None: their own 0 … L − 1)
            x = layer(x, mask, deterministic, positions=given, segment_ids=segment_ids)
        x, logits = self._logits(x)
        return {"hidden_states": x, "logits": logits}

    def prefill(self, input_ids, max_length: int | None = None):
        """A prompt [B, P] -> (logits [B, P, vocab], the cache of every layer for `decode`), evaluation
        mode. `max_length` (default max_positions): the longest sequence the cache will hold."""
        input_ids = self._check(input_ids)
        max_length = int(max_length or self.config["max_positions"])
        x = self._embed(input_ids, jnp.arange(input_ids.shape[1])[None])
        caches = []
        for layer in self.layers:
            x, cache = layer.prefill(x, max_length)
            caches.append(cache)
        return self._logits(x)[1], caches

    def decode(self, token, position, caches):
        """token [B] at `position` (a scalar: the number of tokens before it) -> (logits [B, vocab], caches)."""
        x = self._embed(jnp.asarray(token)[:, None], jnp.reshape(position, (1, 1)))
        new = []
        for layer, cache in zip(self.layers, caches):
            x, cache = layer.decode(x, position, cache)
            new.append(cache)
        logits = self._logits(x)[1][:, 0]
        if self.position_embeddings is not None:      # learned positions end at max_positions (a clamped lookup)
            logits = jnp.where(position < self.config["max_positions"], logits, jnp.nan)
        return logits, new
