"""Vision Transformer (Dosovitskiy et al. 2021) in Flax NNX with any attention kind: patch
embedding, class token or mean pooling, pre-LayerNorm encoder, classification head.

    model(images [B, H, W, C], deterministic=True) ->
        {"hidden_states": [B, 1 + N or N, hidden] (after the final LayerNorm),
         "pooled": [B, hidden], "logits": [B, num_classes] (when num_classes > 0)}

The sequence length is (image_size / patch_size)² (+1 with the class token): CRT Table 12's
sequence-length ablations are `image_size` / `patch_size` overrides.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from favor.models.layers import Mlp, SelfAttention, dense, layer_norm, meta

POOLS = ("cls", "mean")
POSEMBS = ("learn", "sincos2d")


def sincos2d(h, w, dim, temperature=10000.0):
    """Fixed 2-D sine-cosine position embeddings [h·w, dim] (MoCo v3 / big_vision): a quarter of the
    channels each for sin and cos of the row and of the column at geometric frequencies. A prior that
    need not be learned, which matters when the images are few (the digits job)."""
    if dim % 4:
        raise ValueError(f"vit: posemb 'sincos2d' needs hidden divisible by 4; got {dim}")
    y, x = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32), jnp.arange(w, dtype=jnp.float32), indexing="ij")
    omega = 1.0 / temperature ** (jnp.arange(dim // 4, dtype=jnp.float32) / (dim // 4))
    y, x = y.reshape(-1)[:, None] * omega, x.reshape(-1)[:, None] * omega
    return jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)


class ViTLayer(nnx.Module):
    """Pre-LayerNorm block: h = x + attn(LN(x)); out = h + mlp(LN(h))."""

    def __init__(self, c, *, rngs):
        kw = dict(dtype=c["dtype"], param_dtype=c["param_dtype"])
        self.norm_before = layer_norm(c["hidden"], c["layer_norm_eps"], rngs=rngs, param_dtype=c["param_dtype"])
        self.attention = SelfAttention(c["hidden"], c["heads"], c["attention"], rngs=rngs,
                                       dropout=c["attention_dropout"], **kw)
        self.norm_after = layer_norm(c["hidden"], c["layer_norm_eps"], rngs=rngs, param_dtype=c["param_dtype"])
        self.mlp = Mlp(c["hidden"], c["mlp_dim"], rngs=rngs, dropout=c["dropout"], **kw)
        self.dropout = nnx.Dropout(c["dropout"], rngs=rngs)

    def __call__(self, x, deterministic):
        a = self.attention(self.norm_before(x).astype(x.dtype), deterministic=deterministic)
        h = x + self.dropout(a, deterministic=deterministic)
        return h + self.mlp(self.norm_after(h).astype(x.dtype), deterministic=deterministic)


class ViT(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, **c):
        if c["pool"] not in POOLS:
            raise ValueError(f"vit: unknown pool {c['pool']!r}; valid: {', '.join(POOLS)}")
        if c["posemb"] not in POSEMBS:
            raise ValueError(f"vit: unknown posemb {c['posemb']!r}; valid: {', '.join(POSEMBS)}")
        if c["image_size"] % c["patch_size"]:
            raise ValueError(f"vit: image_size {c['image_size']} is not a multiple of patch_size {c['patch_size']}")
        self.config = dict(c)
        h, p, dt, pdt = c["hidden"], c["patch_size"], c["dtype"], c["param_dtype"]
        self.num_patches = (c["image_size"] // p) ** 2
        self.patch_embedding = nnx.Conv(c["channels"], h, (p, p), strides=(p, p), padding="VALID", dtype=dt,
                                        param_dtype=pdt, rngs=rngs, kernel_metadata=meta(None, None, None, "embed"),
                                        bias_metadata=meta("embed"))
        tokens = self.num_patches + (c["pool"] == "cls")
        init = nnx.initializers.normal(0.02)
        self.cls_token = nnx.Param(jnp.zeros((1, 1, h), pdt), **meta(None, None, "embed")) \
            if c["pool"] == "cls" else None
        if c["posemb"] == "learn":
            self.position_embeddings = nnx.Param(init(rngs.params(), (1, tokens, h), pdt), **meta(None, None, "embed"))
        else:   # a constant, not a parameter; the class token (if any) gets none
            grid = c["image_size"] // p
            table = sincos2d(grid, grid, h)
            if c["pool"] == "cls":
                table = jnp.concatenate([jnp.zeros((1, h)), table], 0)
            self.position_embeddings = nnx.Variable(table[None].astype(pdt))
        self.embedding_dropout = nnx.Dropout(c["dropout"], rngs=rngs)
        self.layers = nnx.List([ViTLayer(c, rngs=rngs) for _ in range(c["num_layers"])])
        self.norm = layer_norm(h, c["layer_norm_eps"], rngs=rngs, param_dtype=pdt)
        kw = dict(rngs=rngs, dtype=dt, param_dtype=pdt)
        self.pooler = dense(h, h, ("embed", None), **kw) if c["pooler"] else None   # HF ViTModel's
        self.head = (dense(h, c["num_classes"], ("embed", "classes"), kernel_init=nnx.initializers.zeros, **kw)
                     if c["num_classes"] else None)

    def __call__(self, images, deterministic: bool = True):
        c = self.config
        images = jnp.asarray(images)
        want = (c["image_size"], c["image_size"], c["channels"])
        if images.ndim != 4 or tuple(images.shape[1:]) != want:
            raise ValueError(f"vit: images must be [batch, {want[0]}, {want[1]}, {want[2]}] "
                             f"(image_size={c['image_size']}, channels={c['channels']}); got shape {images.shape}")
        x = self.patch_embedding(images.astype(c["dtype"]))
        b = x.shape[0]
        x = x.reshape(b, -1, x.shape[-1])
        if self.cls_token is not None:
            x = jnp.concatenate([jnp.broadcast_to(self.cls_token[...].astype(x.dtype), (b, 1, x.shape[-1])), x], 1)
        x = self.embedding_dropout(x + self.position_embeddings[...].astype(x.dtype), deterministic=deterministic)
        for layer in self.layers:
            x = layer(x, deterministic)
        x = self.norm(x).astype(x.dtype)
        pooled = x[:, 0] if c["pool"] == "cls" else jnp.mean(x, axis=1)
        out = {"hidden_states": x, "pooled": pooled}
        if self.pooler is not None:
            out["pooler_output"] = jnp.tanh(self.pooler(x[:, 0]))
        if self.head is not None:
            out["logits"] = self.head(pooled).astype(jnp.float32)
        return out
