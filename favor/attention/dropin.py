"""A drop-in `attention_fn` for flax.nnx.MultiHeadAttention.

    mha = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False, rngs=rngs,
                                 attention_fn=attention.attention_fn("favor#", num_features=128))

NNX calls it with query/key/value [B, L, H, D] and keyword arguments (mask, dropout_rng,
dropout_rate, broadcast_dropout, deterministic, dtype, precision, module, is_causal, ...); all are
accepted. Decisions, because linear attention never forms the L×L matrix:
- `mask` [B, H|1, Lq, Lk] is reduced to a key-padding mask (a key is valid if any query may attend
  to it). Padding masks (nnx.make_attention_mask) are exact; other patterns are not representable
  except causal, which comes from `is_causal=True`.
- The random draw: with a `dropout_rng` (training with dropout) ω is redrawn from it, folded with a
  constant so ω and the dropout mask stay independent; otherwise (deterministic evaluation, or no
  dropout) the kind's fixed seed is used. favor's own attention module (the model zoo) carries a
  dedicated rng stream instead.
- Attention dropout needs the L×L weights; random-feature kinds ignore `dropout_rate`. The
  "softmax" kind forwards everything to nnx.dot_product_attention, dropout included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FEATURE_STREAM = 0x0F4F   # folded into dropout_rng so ω is independent of the dropout mask


def attention_fn(kind, **options):
    from favor import attention

    attn = attention.get(kind, **options)

    if kind == "softmax":
        from flax import nnx

        def softmax_fn(query, key, value, bias=None, mask=None, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k in _NNX_DPA_KWARGS}
            return nnx.dot_product_attention(query, key, value, bias=bias, mask=mask, **kwargs)

        return softmax_fn

    def fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
           dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
           is_causal=False, **kwargs):
        del broadcast_dropout, dropout_rate, precision, module, kwargs
        if bias is not None:
            raise ValueError(f"attention kind {kind!r} is linear: an additive bias over the L×L scores "
                             "cannot be applied; pass masks as `mask` instead")
        key_mask = None
        if mask is not None:
            key_mask = jnp.any(jnp.asarray(mask, bool), axis=(-3, -2))      # [B|1, Lk]
            key_mask = jnp.broadcast_to(key_mask, (query.shape[0], key.shape[-3]))
        rng = None if deterministic or dropout_rng is None else jax.random.fold_in(dropout_rng, FEATURE_STREAM)
        out = attn(query, key, value, mask=key_mask, causal=is_causal, rng=rng)
        return out.astype(dtype or query.dtype)

    return fn


_NNX_DPA_KWARGS = ("broadcast_dropout", "dropout_rng", "dropout_rate", "deterministic", "dtype",
                   "precision", "module", "promote_dtype", "is_causal")
