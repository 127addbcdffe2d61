"""The two jitted programs a decoder generates with — the prefill and one decoding step — and how a next
token is drawn from logits. What `python -m favor.tools.generate` runs and `favor.bench generate` times."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from favor.models.decoder import Decoder


def sample(logits, key, temperature: float, top_k: int):
    """Next tokens [B] from logits [B, V]: the argmax at temperature 0, else a draw from softmax(logits / T)
    restricted to the top_k most likely tokens (all of them when top_k is 0)."""
    if temperature == 0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        # exactly k candidates, ties at the k-th value included by position (a threshold would keep them all)
        values, index = jax.lax.top_k(logits, top_k)
        logits = jax.vmap(lambda row, i, v: row.at[i].set(v))(jnp.full_like(logits, -jnp.inf), index, values)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def decoding(model: Decoder, max_length: int, temperature: float = 0.0, top_k: int = 0, seed: int = 0):
    """The two jitted programs of generation:
        prefill(prompt [B, P]) -> (next token [B], its logits [B, V], caches)
        step(token [B], position, caches) -> (next token, its logits, caches)
    with caches for sequences of up to `max_length` tokens; the token at position t is drawn with the key
    fold_in(seed, t), so a sample does not depend on how it was split into calls."""
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)

    @jax.jit
    def prefill(state, ids):
        logits, caches = nnx.merge(graphdef, state).prefill(ids, max_length)
        logits = logits[:, -1]
        return sample(logits, jax.random.fold_in(key, ids.shape[1]), temperature, top_k), logits, caches

    @jax.jit
    def step(state, token, position, caches):
        logits, caches = nnx.merge(graphdef, state).decode(token, position, caches)
        return sample(logits, jax.random.fold_in(key, position + 1), temperature, top_k), logits, caches

    return (lambda ids: prefill(state, ids)), (lambda token, position, caches: step(state, token, position, caches))
