"""Attention over random features: every kind by the name users type.

    from favor import attention
    attention.names()
    attn = attention.get("favor++", num_features=256, coupling="orthogonal", redraw="step")
    out = attn(q, k, v, mask=None, causal=False, rng=key)   # q [B, Lq, H, D] -> [B, Lq, H, Dv]
    fn = attention.attention_fn("favor#", num_features=128)  # for nnx.MultiHeadAttention
"""

from favor.attention.dropin import attention_fn
from favor.attention.kinds import Attention, RandomFeatureAttention, RandomFeatureContext
from favor.attention.registry import (SPEC_OPTIONS, BlockError, block_options, block_redraw, get,
                                      ignored_block_options, learned_kinds, names, parse_spec, parse_specs,
                                      read_block)

__all__ = ["SPEC_OPTIONS", "Attention", "RandomFeatureAttention", "RandomFeatureContext", "attention_fn",
           "block_options", "block_redraw", "get", "ignored_block_options", "learned_kinds", "names", "parse_spec",
           "parse_specs", "BlockError", "read_block"]
