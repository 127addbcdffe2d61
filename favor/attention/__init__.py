"""Attention over random features: every kind by the name users type.

    from favor import attention
    attention.names()
    attn = attention.get("favor++", num_features=256, coupling="orthogonal", redraw="step")
    out = attn(q, k, v, mask=None, causal=False, rng=key)   # q [B, Lq, H, D] -> [B, Lq, H, Dv]
    fn = attention.attention_fn("favor#", num_features=128)  # for nnx.MultiHeadAttention
"""

from favor.attention.dropin import attention_fn
from favor.registry import build
from favor.attention.kinds import KINDS, Attention, RandomFeatureAttention, RandomFeatureContext

_REGISTRY = {cls.name: cls for cls in KINDS}


def names():
    """Every attention kind."""
    return tuple(_REGISTRY)


def get(kind, **options):
    """An attention kind with options; an unknown kind or option is a ValueError listing valid ones."""
    return build("attention kind", _REGISTRY, kind, options)


__all__ = ["Attention", "RandomFeatureAttention", "RandomFeatureContext", "attention_fn", "get", "names"]
