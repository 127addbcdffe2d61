"""Blocks the model zoo shares: projections with logical axis names, self-attention over any kind,
the transformer MLP, rotary positions and the random-feature state.

Every parameter carries `logical_axes` metadata, one name per array dim from
    "vocab", "embed", "heads", "mlp", "kernel", "classes", or None (never sharded);
the training loop maps them onto mesh axes with the config's rules. Parameters are created in
`param_dtype` (float32); layers compute in `dtype` (e.g. bfloat16), LayerNorm in float32.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from favor import attention as attention_lib
from favor.attention import qknorm
from favor.attention.kinds import RandomFeatureAttention, Softmax
from favor.models import rope

AXES = ("vocab", "embed", "heads", "mlp", "kernel", "classes")


class FitStatistics(nnx.Variable):
    """Running statistics of a causal layer's data-dependent fit (favor++, favor#, hrf-cluster,
    importance sampling): averaged over training batches as BatchNorm averages its moments, used by
    every causal call instead of a fit on the sequence itself (which would read the future)."""


class FeatureDraw(nnx.Variable):
    """The random projections of one attention layer (its `base_draw`): state, not a parameter.

    Kept out of nnx.Param so that a softmax and a FAVOR model of the same config have the same
    parameter tree (checkpoints and Hugging Face weights move between them); kept in the model so
    evaluation is deterministic and a checkpoint holds the ω a run was using. The training loop
    replaces it on its redraw schedule (`redraw_features`)."""


# The parameters of the layer's query/key normalisation: a source without qk_norm (a softmax run, a Hugging
# Face checkpoint) lacks them, and uptraining it into a model with qk_norm starts them at their init
QK_NORM_PARAMS = ("qk_logit", "query_norm", "key_norm")


def is_qk_norm_param(path: str) -> bool:
    """Whether dotted parameter `path` belongs to a layer's query/key normalisation."""
    return any(part in QK_NORM_PARAMS for part in path.split("."))


def is_feature_map_param(path: str) -> bool:
    """Whether dotted parameter `path` is a learned kind's feature map or a window's learned mix
    (SelfAttention.feature_map, .window_mix): what attention transfer trains, and what a source of another
    kind has not."""
    return path.endswith(("attention.feature_map", "attention.window_mix"))


def meta(*axes):
    for a in axes:
        if a is not None and a not in AXES:
            raise ValueError(f"unknown logical axis {a!r}; valid: {AXES} or None")
    return {"logical_axes": tuple(axes)}


class Dense(nnx.Linear):
    """nnx.Linear that may carry a LoRA adapter (favor.models.lora): x W + b + lora_scale · x A B. None
    until `lora.add` gives it one; the base parameters keep their paths either way."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora = nnx.data(None)       # a data slot: an adapter module may be put in it later
        self.lora_scale = 0.0

    def __call__(self, x):
        y = super().__call__(x)
        if self.lora is None:
            return y
        return y + (self.lora(x) * self.lora_scale).astype(y.dtype)


def dense(din, dout, axes, *, rngs, dtype=None, param_dtype=jnp.float32, use_bias=True,
          kernel_init=None):
    """A projection [din, dout] (nnx.Linear) whose kernel and bias carry logical axis names."""
    kw = {} if kernel_init is None else {"kernel_init": kernel_init}
    return Dense(din, dout, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                 kernel_metadata=meta(*axes), bias_metadata=meta(axes[-1]), **kw)


def layer_norm(n, eps, *, rngs, param_dtype=jnp.float32, axis="embed"):
    """LayerNorm computed in float32 whatever the compute dtype (variance in bf16 is too coarse)."""
    return nnx.LayerNorm(n, epsilon=eps, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs,
                         scale_metadata=meta(axis), bias_metadata=meta(axis))


def attention_spec(attention: Mapping[str, Any]) -> tuple[str, dict, dict]:
    """{'kind': 'favor#', 'num_features': 128, 'qk_norm': 'l2', ...} -> ('favor#', {'num_features': 128,
    ...}, {'qk_norm': 'l2', 'qk_radius': ..., 'qk_radius_max': ...}): the kind, its options, and the
    layer's query/key normalisation (favor.attention.qknorm), which every kind takes."""
    return attention_lib.read_block(attention, from_config=False)


def rotary(x, positions, base=10000.0, scaling=""):
    """Rotary position embedding (RoFormer) on [B, L, H, D] with positions [B, L] or [L]; `scaling` a
    long-context rescaling of its frequencies (favor.models.rope).

    Rotating q and k by position-dependent angles makes qᵀk depend on the offset only, for the
    exact kernel and equally for every random-feature estimate of exp(qᵀk) (they are functions of
    the rotated vectors), so it gives linear attention relative positions at no extra cost."""
    freqs = jnp.asarray(rope.frequencies(x.shape[-1], float(base), str(scaling)))
    angles = jnp.asarray(positions, jnp.float32)[..., None] * freqs       # [(B,) L, D/2]
    if angles.ndim == 2:
        angles = angles[None]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class SelfAttention(nnx.Module):
    """Multi-head self-attention with separate query/key/value/output projections (the layout of
    BERT and ViT checkpoints) over any attention kind.

    Attention dropout drops whole keys (per example, shared by heads and queries) through the key
    mask: linear attention never forms the attention matrix, so this is the one dropout that means
    the same for every kind; the normaliser renormalises over the kept keys.

    `qk_norm` in the attention block (favor.attention.qknorm): "l2" puts each head's queries and keys
    on a sphere whose radius is a learned per-head parameter `qk_logit` (radius qk_radius_max·sigmoid),
    "layernorm" applies LayerNorms `query_norm`/`key_norm` over the head dim; both before rotary
    positions.
    """

    def __init__(self, hidden: int, heads: int, attention: Mapping[str, Any], *, rngs: nnx.Rngs,
                 dropout: float = 0.0, causal: bool = False, use_rotary: bool = False,
                 rotary_base: float = 10000.0, rope_scaling: str = "", use_bias: bool = True,
                 qkv_bias: bool = False, dtype=None, param_dtype=jnp.float32):
        """use_bias: biases on all four projections (BERT, ViT, GPT-2); qkv_bias: on the query, key and
        value projections alone (Qwen2)."""
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of the number of heads {heads}")
        self.heads, self.head_dim = heads, hidden // heads
        self.causal, self.use_rotary, self.rotary_base = causal, use_rotary, float(rotary_base)
        self.rope_scaling = str(rope_scaling)
        if use_rotary:
            rope.frequencies(self.head_dim, self.rotary_base, self.rope_scaling)   # a bad head dim or scaling: now
        kind, options, qk = attention_spec(attention)
        self.kind = attention_lib.get(kind, **options)
        proj = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias)
        qkv = dict(proj, use_bias=use_bias or qkv_bias)
        self.query = dense(hidden, hidden, ("embed", "heads"), **qkv)
        self.key = dense(hidden, hidden, ("embed", "heads"), **qkv)
        self.value = dense(hidden, hidden, ("embed", "heads"), **qkv)
        self.out = dense(hidden, hidden, ("heads", "embed"), **proj)
        self.qk_norm, self.qk_radius_max = qk["qk_norm"], float(qk["qk_radius_max"])
        # a vector of `heads` numbers: never sharded, and outside the weight-decay mask (matrices only)
        self.qk_logit = nnx.Param(jnp.full((heads,), qknorm.initial_logit(qk["qk_radius"], self.qk_radius_max),
                                           param_dtype), **meta(None)) if self.qk_norm == "l2" else None
        if self.qk_norm == "layernorm":
            self.query_norm = layer_norm(self.head_dim, 1e-6, rngs=rngs, param_dtype=param_dtype, axis=None)
            self.key_norm = layer_norm(self.head_dim, 1e-6, rngs=rngs, param_dtype=param_dtype, axis=None)
        else:
            self.query_norm = self.key_norm = None
        self.key_dropout = nnx.Dropout(dropout, rngs=rngs)
        if isinstance(self.kind, RandomFeatureAttention):
            self.features = FeatureDraw(self.kind.base_draw(rngs.features(), self.head_dim))
        else:
            self.features = None
        if getattr(self.kind, "learned", False):
            # a learned feature map's weights (Hedgehog, T2R): parameters, never sharded (a few per head)
            w = self.kind.init_weights(rngs.params(), heads, self.head_dim).astype(param_dtype)
            self.feature_map = nnx.Param(w, **meta(*(None,) * w.ndim))
        else:
            self.feature_map = None
        # the window's learned mix (LoLCATs): a logit per head, γ_h = sigmoid, never sharded
        self.window_mix = (nnx.Param(self.kind.mix_init(heads).astype(param_dtype), **meta(None))
                           if getattr(self.kind, "mixes", False) else None)
        if causal and self.kind.data_dependent:
            # statistics of no data: the fit then falls back to the family's data-independent member
            empty = jnp.zeros((1, 1, heads, self.head_dim), jnp.float32)
            none = jnp.zeros((1, 1), bool)
            self.fit_stats = FitStatistics(self.kind.statistics(empty, empty, none, none))
        else:
            self.fit_stats = None
        # attention transfer (favor.uptrain.transfer): a teacher's layers sow (input, mask, output) when set
        self.record = False

    def redraw(self, key):
        if self.features is not None:
            self.features.set_value(self.kind.base_draw(key, self.head_dim))

    def radius(self):
        """Each head's sphere radius [heads] under qk_norm="l2" (None otherwise)."""
        return None if self.qk_logit is None else qknorm.radius(self.qk_logit[...], self.qk_radius_max)

    def project(self, x, positions=None):
        """x [B, L, hidden] -> q, k, v [B, L, heads, head_dim] (rotary positions applied to q and k)."""
        b, l, _ = x.shape
        split = lambda t: t.reshape(b, l, self.heads, self.head_dim)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        if self.qk_logit is not None:
            q, k = qknorm.on_sphere(q, k, self.radius())
        elif self.query_norm is not None:
            q, k = self.query_norm(q).astype(q.dtype), self.key_norm(k).astype(k.dtype)
        if self.use_rotary:
            pos = jnp.arange(l) if positions is None else positions
            q, k = (rotary(t, pos, self.rotary_base, self.rope_scaling) for t in (q, k))
        return q, k, v

    def __call__(self, x, mask=None, *, deterministic: bool = True, positions=None, segment_ids=None):
        """x [B, L, hidden], mask [B, L] (True = token) -> [B, L, hidden]. `positions` [B, L] the rotary
        positions (default 0 … L − 1), `segment_ids` [B, L] packed documents: a token attends only to
        its own document's tokens (favor.attention.documents)."""
        b, l, _ = x.shape
        q, k, v = self.project(x, positions)
        key_mask = None if mask is None else jnp.asarray(mask, bool)
        if not deterministic and self.key_dropout.rate > 0:
            kept = self.key_dropout(jnp.ones((b, l), jnp.float32), deterministic=False) > 0
            key_mask = kept if key_mask is None else key_mask & kept
        draw = self._stored()
        query_mask = None if mask is None else jnp.asarray(mask, bool)
        stats = None
        if self.fit_stats is not None:
            stats = self.fit_stats.get_value()       # this call uses what earlier batches gave
            if not deterministic:
                self.fit_stats.set_value(self.kind.update_statistics(stats, q, k, key_mask, query_mask))
        documents = {} if segment_ids is None else {"segment_ids": segment_ids}
        out = self.kind(q, k, v, mask=key_mask, causal=self.causal, draw=draw, query_mask=query_mask,
                        stats=stats, **self._mix(), **documents)
        result = self.out(out.reshape(b, l, self.heads * self.head_dim).astype(x.dtype))
        if self.record:
            self.sow(nnx.Intermediate, "transfer", (x, mask, positions, segment_ids, result))
        return result

    # -- incremental decoding (causal layers) ----------------------------------------------------------
    def _stored(self):
        """What the kind takes as `draw`: the stored ω of a random-feature kind, a learned map's weights,
        or None."""
        if self.features is not None:
            return self.features.get_value()
        return None if self.feature_map is None else self.feature_map[...]

    def _mix(self):
        """The learned window mix as the kind takes it (`mix=`), or nothing."""
        return {} if self.window_mix is None else {"mix": self.window_mix[...]}

    def _draw_and_stats(self):
        """The stored ω (or learned map) and the running fit statistics (None where the layer has none)."""
        return self._stored(), None if self.fit_stats is None else self.fit_stats.get_value()

    def _decode_context(self):
        draw, stats = self._draw_and_stats()
        return self.kind.decode_context(self.head_dim, draw=draw, stats=stats)

    def prefill(self, x, max_length: int):
        """A prompt x [B, P, hidden] -> (the causal outputs [B, P, hidden], the cache decoding continues
        from). Linear kinds keep a state whose size does not depend on the length (their prefill absorbs
        the prompt's keys at once); softmax keeps every key and value up to `max_length` positions."""
        if not self.causal:
            raise ValueError("prefill/decode need a causal attention layer")
        b, p, _ = x.shape
        if p > max_length:
            raise ValueError(f"a prompt of {p} tokens does not fit a cache of max_length {max_length}")
        q, k, v = self.project(x)
        draw, stats = self._draw_and_stats()
        # an empty prompt has no outputs (the causal pass's chunking needs a token); its cache is the empty state
        out = v if p == 0 else self.kind(q, k, v, causal=True, draw=draw, stats=stats, **self._mix())
        out = self.out(out.reshape(b, p, self.heads * self.head_dim).astype(x.dtype))
        if isinstance(self.kind, Softmax):
            grow = lambda a: jnp.pad(a, ((0, 0), (0, max_length - p), (0, 0), (0, 0)))
            return out, {"k": grow(k), "v": grow(v)}
        return out, self.kind.decode_prefill(k, v, self._decode_context())

    def decode(self, x, position, cache):
        """One token x [B, 1, hidden] at `position` (its index in the sequence, a scalar) -> (out [B, 1,
        hidden], cache): the causal pass's output at that position."""
        b = x.shape[0]
        q, k, v = self.project(x, jnp.reshape(position, (1,)))
        if isinstance(self.kind, Softmax):
            at = lambda c, new: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), position, axis=1)
            cache = {"k": at(cache["k"], k), "v": at(cache["v"], v)}
            seen = jnp.arange(cache["k"].shape[1]) <= position
            if self.kind.window:        # sliding-window softmax: the band's last w + 1 keys
                seen = seen & (jnp.arange(cache["k"].shape[1]) >= position - self.kind.window)
            # the band is the mask above: the cache's positions are not the query's, so the kind's own
            # window (which relates positions of one sequence) stays off
            plain = self.kind if not self.kind.window else attention_lib.get("softmax", impl=self.kind.impl)
            out = plain(q, cache["k"], cache["v"], mask=jnp.broadcast_to(seen, (b, seen.shape[0])))
            # past the cache the write above is clamped onto its last slot; the position is traced, so no
            # error can be raised here: NaN outputs make the overflow loud instead of silently wrong
            out = jnp.where(position < cache["k"].shape[1], out, jnp.nan)
        else:
            out, cache = self.kind.decode_step(cache, q, k, v, self._decode_context(), **self._mix())
        return self.out(out.reshape(b, 1, self.heads * self.head_dim).astype(x.dtype)), cache


class Mlp(nnx.Module):
    """hidden -> mlp -> hidden with an activation between and dropout after."""

    def __init__(self, hidden: int, mlp: int, *, rngs: nnx.Rngs, activation=None, dropout=0.0,
                 dtype=None, param_dtype=jnp.float32):
        proj = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.intermediate = dense(hidden, mlp, ("embed", "mlp"), **proj)
        self.output = dense(mlp, hidden, ("mlp", "embed"), **proj)
        self.activation = activation or (lambda u: jax.nn.gelu(u, approximate=False))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x, *, deterministic: bool = True):
        h = self.activation(self.intermediate(x))
        return self.dropout(self.output(h), deterministic=deterministic)


def attention_layers(model: nnx.Module):
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, SelfAttention)]


def redraw_features(model: nnx.Module, key) -> None:
    """Fresh ω for every random-feature attention layer of `model`, each from its own fold of key."""
    for i, layer in enumerate(attention_layers(model)):
        layer.redraw(jax.random.fold_in(key, i))


def logical_axes(model: nnx.Module):
    """The parameter tree with each leaf replaced by its tuple of logical axis names."""
    params = nnx.state(model, nnx.Param)
    return jax.tree.map(lambda v: v.get_metadata().get("logical_axes", (None,) * len(v.get_value().shape)), params,
                        is_leaf=lambda v: isinstance(v, nnx.Variable))
