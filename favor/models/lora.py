"""LoRA adapters for uptraining: a frozen projection W plus a trained low-rank update,
y = x W + b + (α / r) · x A B, A [in, r], B [r, out] (Hu et al., 2021; LoLCATs' second stage trains these
on the query, key, value and output projections, rank 8).

Adapters live inside the model's own projections (`favor.models.layers.Dense.lora`, an `nnx.LoRA` whose
parameters are `nnx.LoRAParam`), so a model with adapters runs the one code path and keeps its base
parameters' paths: a checkpoint of a LoRA run holds `<projection>.kernel` as it started and
`<projection>.lora.lora_a` / `lora_b` beside it. B starts at zero, so a model with fresh adapters computes
exactly what it did without them. `merge` folds trained adapters into the kernels (what `init_from` does
with a LoRA run's checkpoint), leaving a model that needs none.
"""

from __future__ import annotations

import re

import numpy as np
from flax import nnx

from favor.config import blocks
from favor.models.layers import Dense, meta

# the query, key, value and output projections of every attention block, in every model family
DEFAULT_TARGETS = blocks.LORA_TARGETS
# a parameter path that belongs to an adapter
PARAM = re.compile(r"(^|\.)lora\.lora_[ab]$")


def is_lora_param(path: str) -> bool:
    return bool(PARAM.search(path))


def add(model, rank: int, alpha: float, pattern: str = DEFAULT_TARGETS, *, rngs: nnx.Rngs) -> list[str]:
    """Give every projection `pattern` (a regular expression searched in its dotted path) selects a
    rank-`rank` adapter scaled by alpha / rank (A drawn He-uniform, B zero); returns their paths. An
    error naming the model's projections when it selects none."""
    regex = re.compile(pattern)
    projections = {".".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, Dense)}
    chosen = sorted(p for p in projections if regex.search(p))
    if not chosen:
        names = sorted(projections)
        raise ValueError(f"LoRA targets {pattern!r} select no projection of this model; its projections: "
                         f"{', '.join(names[:8])}{', …' if len(names) > 8 else ''}")
    for path in chosen:
        m = projections[path]
        din, dout = m.kernel.shape
        axes = m.kernel.get_metadata().get("logical_axes", (None, None))
        m.lora = nnx.LoRA(din, rank, dout, dtype=m.dtype, param_dtype=m.param_dtype, rngs=rngs,
                          a_metadata=meta(axes[0], None), b_metadata=meta(None, axes[1]))
        m.lora_scale = float(alpha) / int(rank)
    return chosen


def merged_kernel(kernel, a, b, scale: float):
    """W + scale · A B in float32, cast back to W's dtype."""
    w = np.asarray(kernel, np.float32) + scale * (np.asarray(a, np.float32) @ np.asarray(b, np.float32))
    return w.astype(np.asarray(kernel).dtype)


def merge(flat: dict, scale: float) -> dict:
    """A flat {dotted path: array} parameter dict with every adapter folded into its kernel and removed."""
    out = {k: v for k, v in flat.items() if not is_lora_param(k)}
    for path in [k for k in flat if k.endswith(".lora.lora_a")]:
        base = path[: -len(".lora.lora_a")]
        out[f"{base}.kernel"] = merged_kernel(flat[f"{base}.kernel"], flat[path], flat[f"{base}.lora.lora_b"], scale)
    return out


__all__ = ["DEFAULT_TARGETS", "add", "is_lora_param", "merge", "merged_kernel"]
