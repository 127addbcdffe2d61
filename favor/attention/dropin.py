"""A drop-in `attention_fn` for flax.nnx.MultiHeadAttention.

    mha = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False, rngs=rngs,
                                 attention_fn=attention.attention_fn("favor#", num_features=128))

NNX calls it with query/key/value [B, L, H, D] and keyword arguments (mask, dropout_rng,
dropout_rate, broadcast_dropout, deterministic, dtype, precision, module, is_causal, ...); all are
accepted. Decisions, because linear attention never forms the L×L matrix:
- `mask` [B|1, H|1, Lq, Lk] must be a padding mask (query validity × key validity, as
  `nnx.make_attention_mask` builds) or that combined with the causal triangle (as
  `nnx.make_causal_mask` gives; queries aligned to the last keys): the causal one runs the causal
  algorithm, exactly. Any other pattern (blocks, sliding windows, per-head masks) cannot be
  represented and is an error naming what is supported — with a concrete mask a ValueError at the
  call; under jit the pattern is only known at run time, so the outputs become NaN and a host
  callback raises with the same message (a silent approximation is the one thing it must not do).
- The random draw: with a `dropout_rng` (training with dropout) ω is redrawn from it, folded with a
  constant so ω and the dropout mask stay independent; otherwise (deterministic evaluation, or no
  dropout) the kind's fixed seed is used. favor's own attention module (the model zoo) carries a
  dedicated rng stream instead.
- Attention dropout needs the L×L weights; random-feature kinds ignore `dropout_rate`. The
  "softmax" kind forwards everything to nnx.dot_product_attention, dropout included.
- `qk_norm="l2"` puts queries and keys on the sphere of radius `qk_radius` (a constant: an attention_fn
  owns no parameters; favor's own layer learns the radius per head). For QK-LayerNorm use
  `nnx.MultiHeadAttention(normalize_qk=True, ...)`, which owns the LayerNorms; `qk_norm="layernorm"`
  here is an error saying so.
- Causal data-dependent kinds (favor++, favor#, hrf-cluster, importance sampling) need fit statistics
  that do not come from the sequence: pass `stats=` here (e.g. `attn.statistics(q, k)` of a
  calibration batch); favor's own causal layers keep running statistics instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from favor.attention import qknorm, registry

FEATURE_STREAM = 0x0F4F   # folded into dropout_rng so ω is independent of the dropout mask
MASK_HELP = ("linear attention takes a padding mask (nnx.make_attention_mask of query and key validity) "
             "or one combined with the causal triangle (nnx.make_causal_mask, or is_causal=True); "
             "other patterns (block, sliding-window, per-head) cannot be represented")


def _padding_parts(mask, lq, lk):
    """(query_valid [B, Lq], key_valid [B, Lk], as_padding, as_causal) of a [B, H, Lq, Lk] mask.

    The mask is a padding mask iff it equals the outer product of its row- and column-validity, and a
    causal one iff it equals that product with the triangle j ≤ i + Lk − Lq (where every row that can
    see a key keeps its first valid key). Works on numpy and on traced arrays."""
    xp = np if isinstance(mask, np.ndarray) else jnp
    m = mask.astype(bool)
    head = m[:, 0]                                               # heads must agree
    same_heads = xp.all(m == head[:, None])
    tri = np.tril(np.ones((lq, lk), bool), k=lk - lq)
    key_valid = xp.any(head, axis=-2)                             # [B, Lk]
    query_valid = xp.any(head, axis=-1)                           # [B, Lq]
    outer = query_valid[:, :, None] & key_valid[:, None, :]
    as_padding = same_heads & xp.all(head == outer)
    # causal: rows see a prefix of the valid keys; a row's validity is "sees some key", so compare with
    # the triangle over the key validity, restricted to rows that see something
    causal_outer = key_valid[:, None, :] & tri[None]
    row_seen = xp.any(causal_outer, axis=-1)
    query_causal = query_valid | ~row_seen
    as_causal = same_heads & xp.all(head == (causal_outer & query_causal[:, :, None]))
    return query_valid, key_valid, as_padding, as_causal


def _raise_mask_error(ok, causal_without_stats=False):
    if bool(causal_without_stats):
        raise ValueError("attention_fn: a causal mask needs fit statistics for this data-dependent kind "
                         "(a fit on the sequence would read the future): pass attention_fn(kind, stats=...)")
    if not bool(ok):
        raise ValueError(f"attention_fn: the mask is neither a padding mask nor a causal one: {MASK_HELP}")


def attention_fn(kind, stats=None, **options):
    options, qk = qknorm.split(options)
    if qk["qk_norm"] == "layernorm":
        raise ValueError("attention_fn: for QK-LayerNorm use nnx.MultiHeadAttention(normalize_qk=True, "
                         "attention_fn=attention_fn(kind)), which owns the LayerNorms' learned scales; an "
                         "attention_fn owns no parameters")
    attn = registry.get(kind, **options)
    if getattr(attn, "learned", False):
        raise ValueError(f"attention_fn: {kind!r} has a learned feature map, whose weights are parameters, and "
                         "an attention_fn owns none; use favor's SelfAttention (favor.models), which holds them")
    if getattr(attn, "mixes", False):
        raise ValueError(f"attention_fn: window_mix='learned' trains a mixing weight per head, a parameter an "
                         "attention_fn does not own; use window_mix='shared' or favor's SelfAttention (favor.models)")
    # qk_norm="l2": an attention_fn owns no parameters, so the sphere's radius is the constant qk_radius
    # here (favor's own attention layer learns one per head)
    sphere = (lambda q, k: qknorm.on_sphere(q, k, jnp.full((q.shape[-2],), float(qk["qk_radius"])))) \
        if qk["qk_norm"] == "l2" else (lambda q, k: (q, k))

    if kind == "softmax":
        def softmax_fn(query, key, value, bias=None, mask=None, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k in _NNX_DPA_KWARGS}
            query, key = sphere(query, key)
            return nnx.dot_product_attention(query, key, value, bias=bias, mask=mask, **kwargs)

        return softmax_fn

    # causal data-dependent attention needs statistics from outside the sequence (kinds.py)
    causal_ok = not (getattr(attn, "data_dependent", False) and stats is None)

    def run(query, key, value, rng, key_mask, query_mask, causal):
        query, key = sphere(query, key)
        return attn(query, key, value, mask=key_mask, query_mask=query_mask, causal=causal, rng=rng, stats=stats)

    def fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
           dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
           is_causal=False, **kwargs):
        del broadcast_dropout, dropout_rate, precision, module, kwargs
        if bias is not None:
            raise ValueError(f"attention kind {kind!r} is linear: an additive bias over the L×L scores "
                             "cannot be applied; pass masks as `mask` instead")
        rng = None if deterministic or dropout_rng is None else jax.random.fold_in(dropout_rng, FEATURE_STREAM)
        b, lq, lk = query.shape[0], query.shape[-3], key.shape[-3]
        if mask is None:
            out = run(query, key, value, rng, None, None, is_causal)
            return out.astype(dtype or query.dtype)
        if not isinstance(mask, jax.core.Tracer):                 # concrete: decide and fail here
            full = np.broadcast_to(np.asarray(mask), (b, np.shape(mask)[-3], lq, lk))
            qv, kv, as_padding, as_causal = _padding_parts(full, lq, lk)
            _raise_mask_error(as_padding or as_causal)
            causal = bool(is_causal or not as_padding)   # a causal mask runs the causal algorithm
            out = run(query, key, value, rng, jnp.asarray(kv), jnp.asarray(qv), causal)
            return out.astype(dtype or query.dtype)
        full = jnp.broadcast_to(mask, (b, mask.shape[-3], lq, lk))
        qv, kv, as_padding, as_causal = _padding_parts(full, lq, lk)
        ok = as_padding | as_causal
        if is_causal:   # the algorithm applies the triangle; the mask adds padding (or the triangle again)
            out = run(query, key, value, rng, kv, qv, True)
        elif not causal_ok:   # this kind cannot run causally here: only padding masks are valid
            ok = as_padding
            out = run(query, key, value, rng, kv, qv, False)
            jax.debug.callback(_raise_mask_error, ok, as_causal & ~as_padding)
            return jnp.where(ok, out, jnp.nan).astype(dtype or query.dtype)
        else:           # a lower-triangular pattern is recognised as causal at run time (both compiled)
            out = jax.lax.cond(as_padding, lambda: run(query, key, value, rng, kv, qv, False),
                               lambda: run(query, key, value, rng, kv, qv, True))
        jax.debug.callback(_raise_mask_error, ok)
        out = jnp.where(ok, out, jnp.nan)
        return out.astype(dtype or query.dtype)

    return fn


_NNX_DPA_KWARGS = ("broadcast_dropout", "dropout_rng", "dropout_rate", "deterministic", "dtype",
                   "precision", "module", "promote_dtype", "is_causal")
