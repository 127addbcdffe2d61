"""Conformer encoder (Gulati et al. 2020) in Flax NNX with any attention kind and a CTC head.

    model(features [B, T, F], lengths [B] = None, deterministic=True) ->
        {"hidden_states": [B, T', hidden] (after the final LayerNorm; 0 at padded frames),
         "logits": [B, T', vocab_size + 1] float32, CTC outputs with index 0 the blank
                   (label k of a vocab_size vocabulary is output k + 1),
         "lengths": [B] valid output frames, "mask": [B, T'] bool (True = valid frame)}

`features` are log-mel frames and `lengths` the number of valid frames per example (None = all T).

Convolutional subsampling (4×): two 3×3 convolutions with stride 2 and VALID padding over
(time, frequency), ReLU after each, then the channels × reduced frequencies are flattened and
projected to `hidden`. Each VALID stride-2 convolution maps L frames to (L - 3) // 2 + 1, so
T' = ((T - 3) // 2 + 1 - 3) // 2 + 1 (T ≥ 7) and output frame i reads input frames 4i .. 4i + 6: a
valid output frame reads valid input frames only, whatever the padding holds.

Each block is the macaron block of the paper:
    x = x + ½ FF(x);  x = x + Dropout(MHSA(LN(x)));  x = x + Conv(x);  x = x + ½ FF(x);  x = LN(x)
with FF = LN → dense(hidden, mlp_ratio·hidden) → swish → dropout → dense → dropout and
Conv = LN → pointwise (hidden → 2·hidden) → GLU → depthwise 1-D conv (conv_kernel, SAME) →
BatchNorm or LayerNorm (`conv_norm`) → swish → pointwise (hidden → hidden) → dropout.
A final LayerNorm follows the blocks, then the CTC projection. `self_attention=False` leaves the MHSA
step out of every block (½FF, Conv, ½FF): the model without attention's global mixing (the
depthwise convolution still sees conv_kernel frames), the floor an attention ablation must clear.

Positions are rotary (RoFormer) rather than the original Transformer-XL relative-position bias:
rotating q and k by position-dependent angles makes qᵀk depend on the offset only, and every
random-feature estimate of exp(qᵀk) is a function of the rotated vectors, so linear / random-feature
attention gets relative position information at no extra cost; a relative-position bias needs the
L × L score matrix, which linear attention never forms.

Padding: padded frames are keys masked out of attention, are zeroed before every depthwise
convolution (so nothing leaks into valid frames through the kernel), and are left out of the
BatchNorm statistics in training (mask passed to nnx.BatchNorm; in evaluation the running averages
are used). Valid outputs therefore do not depend on padded inputs. Hidden states are zeroed at padded
output frames; logits there are left as computed (use the returned mask / lengths).

Logical axes: the conv module's inner channels (between its two pointwise projections) are "mlp",
column- then row-parallel like the feed-forward; the subsampling convolutions' output channels are
"embed" (as ViT's patch embedding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from favor.models.layers import SelfAttention, dense, layer_norm, meta

CONV_NORMS = ("batch", "layer")
MIN_FRAMES = 7   # two VALID 3-wide stride-2 convolutions need 7 frames for one output


def subsampled_length(length):
    """Valid frames after the two VALID 3-wide stride-2 convolutions (array or int; clipped at 0)."""
    for _ in range(2):
        length = jnp.maximum((length - 3) // 2 + 1, 0)
    return length


def _conv_out(n):
    for _ in range(2):
        n = (n - 3) // 2 + 1
    return n


class FeedForward(nnx.Module):
    """LN → dense(hidden, mlp_ratio·hidden) → swish → dropout → dense → dropout."""

    def __init__(self, c, *, rngs):
        h, pdt = c["hidden"], c["param_dtype"]
        proj = dict(rngs=rngs, dtype=c["dtype"], param_dtype=pdt)
        self.norm = layer_norm(h, c["layer_norm_eps"], rngs=rngs, param_dtype=pdt)
        self.intermediate = dense(h, c["mlp_ratio"] * h, ("embed", "mlp"), **proj)
        self.output = dense(c["mlp_ratio"] * h, h, ("mlp", "embed"), **proj)
        self.dropout = nnx.Dropout(c["dropout"], rngs=rngs)

    def __call__(self, x, deterministic):
        u = jax.nn.swish(self.intermediate(self.norm(x).astype(x.dtype)))
        u = self.dropout(u, deterministic=deterministic)
        return self.dropout(self.output(u), deterministic=deterministic)


class ConvModule(nnx.Module):
    """LN → pointwise (2·hidden) → GLU → mask → depthwise conv → BatchNorm|LayerNorm → swish →
    pointwise → dropout."""

    def __init__(self, c, *, rngs):
        h, dt, pdt = c["hidden"], c["dtype"], c["param_dtype"]
        proj = dict(rngs=rngs, dtype=dt, param_dtype=pdt)
        self.norm = layer_norm(h, c["layer_norm_eps"], rngs=rngs, param_dtype=pdt)
        self.pointwise_in = dense(h, 2 * h, ("embed", "mlp"), **proj)
        self.depthwise = nnx.Conv(h, h, (c["conv_kernel"],), padding="SAME", feature_group_count=h,
                                  kernel_metadata=meta(None, None, "mlp"), bias_metadata=meta("mlp"),
                                  **proj)
        self.conv_norm = c["conv_norm"]
        if c["conv_norm"] == "batch":
            self.conv_norm_layer = nnx.BatchNorm(h, epsilon=c["layer_norm_eps"], dtype=jnp.float32,
                                                 param_dtype=pdt, rngs=rngs, scale_metadata=meta("mlp"),
                                                 bias_metadata=meta("mlp"))
        else:
            self.conv_norm_layer = layer_norm(h, c["layer_norm_eps"], rngs=rngs, param_dtype=pdt, axis="mlp")
        self.pointwise_out = dense(h, h, ("mlp", "embed"), **proj)
        self.dropout = nnx.Dropout(c["dropout"], rngs=rngs)

    def __call__(self, x, mask, deterministic):
        u = jax.nn.glu(self.pointwise_in(self.norm(x).astype(x.dtype)), axis=-1)
        u = jnp.where(mask[..., None], u, 0).astype(x.dtype)      # no padding through the kernel
        u = self.depthwise(u)
        if self.conv_norm == "batch":
            # Training: statistics over the valid frames of the batch only; evaluation: running averages.
            u = self.conv_norm_layer(u, use_running_average=deterministic, mask=mask[..., None])
        else:
            u = self.conv_norm_layer(u)
        u = jax.nn.swish(u.astype(x.dtype))
        return self.dropout(self.pointwise_out(u), deterministic=deterministic)


class ConformerBlock(nnx.Module):
    """Macaron block: ½FF, MHSA, Conv, ½FF, each residual, then LayerNorm."""

    def __init__(self, c, *, rngs):
        pdt = c["param_dtype"]
        self.ff_before = FeedForward(c, rngs=rngs)
        self.use_attention = bool(c["self_attention"])
        if self.use_attention:
            self.attention_norm = layer_norm(c["hidden"], c["layer_norm_eps"], rngs=rngs, param_dtype=pdt)
            self.attention = SelfAttention(c["hidden"], c["heads"], c["attention"], rngs=rngs,
                                           dropout=c["attention_dropout"], use_rotary=True,
                                           dtype=c["dtype"], param_dtype=pdt)
            self.attention_dropout = nnx.Dropout(c["dropout"], rngs=rngs)
        self.conv = ConvModule(c, rngs=rngs)
        self.ff_after = FeedForward(c, rngs=rngs)
        self.output_norm = layer_norm(c["hidden"], c["layer_norm_eps"], rngs=rngs, param_dtype=pdt)

    def __call__(self, x, mask, deterministic):
        x = x + 0.5 * self.ff_before(x, deterministic)
        if self.use_attention:
            a = self.attention(self.attention_norm(x).astype(x.dtype), mask, deterministic=deterministic)
            x = x + self.attention_dropout(a, deterministic=deterministic)
        x = x + self.conv(x, mask, deterministic)
        x = x + 0.5 * self.ff_after(x, deterministic)
        return self.output_norm(x).astype(x.dtype)


class Conformer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, **c):
        if c["conv_norm"] not in CONV_NORMS:
            raise ValueError(f"conformer: unknown conv_norm {c['conv_norm']!r}; valid: {', '.join(CONV_NORMS)}")
        if c["features"] < MIN_FRAMES:
            raise ValueError(f"conformer: features {c['features']} is too few for the 4× subsampling "
                             f"(two 3×3 stride-2 VALID convolutions need at least {MIN_FRAMES})")
        if c["conv_kernel"] < 1:
            raise ValueError(f"conformer: conv_kernel must be positive; got {c['conv_kernel']}")
        self.config = dict(c)
        h, ch, dt, pdt = c["hidden"], c["subsampling_channels"], c["dtype"], c["param_dtype"]
        conv = dict(strides=(2, 2), padding="VALID", dtype=dt, param_dtype=pdt, rngs=rngs,
                    kernel_metadata=meta(None, None, None, "embed"), bias_metadata=meta("embed"))
        self.subsample1 = nnx.Conv(1, ch, (3, 3), **conv)
        self.subsample2 = nnx.Conv(ch, ch, (3, 3), **conv)
        self.subsample_proj = dense(ch * _conv_out(c["features"]), h, (None, "embed"), rngs=rngs, dtype=dt,
                                    param_dtype=pdt)
        self.input_dropout = nnx.Dropout(c["dropout"], rngs=rngs)
        self.layers = nnx.List([ConformerBlock(c, rngs=rngs) for _ in range(c["num_layers"])])
        self.final_norm = layer_norm(h, c["layer_norm_eps"], rngs=rngs, param_dtype=pdt)
        self.ctc_head = dense(h, c["vocab_size"] + 1, ("embed", "vocab"), rngs=rngs, dtype=dt, param_dtype=pdt)

    def __call__(self, features, lengths=None, deterministic: bool = True):
        c = self.config
        features = jnp.asarray(features)
        if features.ndim != 3 or features.shape[-1] != c["features"]:
            raise ValueError(f"conformer: features must be [batch, frames, {c['features']}] "
                             f"(features={c['features']}); got shape {features.shape}")
        b, t, _ = features.shape
        if t < MIN_FRAMES:
            raise ValueError(f"conformer: {t} frames are too few for the 4× subsampling; need at least "
                             f"{MIN_FRAMES}")
        if lengths is None:
            lengths = jnp.full((b,), t, jnp.int32)
        lengths = jnp.asarray(lengths)
        if lengths.shape != (b,):
            raise ValueError(f"conformer: lengths must be [batch] = ({b},); got shape {lengths.shape}")
        lengths = subsampled_length(jnp.clip(lengths.astype(jnp.int32), 0, t))

        x = jax.nn.relu(self.subsample1(features.astype(c["dtype"])[..., None]))   # [B, T1, F1, C]
        x = jax.nn.relu(self.subsample2(x))                                         # [B, T', F', C]
        t_out = x.shape[1]
        x = self.subsample_proj(x.transpose(0, 1, 3, 2).reshape(b, t_out, -1))     # channels × freq
        mask = jnp.arange(t_out)[None, :] < lengths[:, None]
        x = jnp.where(mask[..., None], x, 0).astype(x.dtype)
        x = self.input_dropout(x, deterministic=deterministic)
        for layer in self.layers:
            x = layer(x, mask, deterministic)
        x = self.final_norm(x).astype(x.dtype)
        x = jnp.where(mask[..., None], x, 0).astype(x.dtype)
        return {"hidden_states": x, "logits": self.ctc_head(x).astype(jnp.float32), "lengths": lengths,
                "mask": mask}
