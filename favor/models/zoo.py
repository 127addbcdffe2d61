"""The model zoo by name: the families (BERT, ViT, Conformer, the decoder LM), their presets, and the checked keyword
set a model is built from."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from favor import attention as attention_lib
from favor import presets
from favor.models.bert import Bert
from favor.models.conformer import Conformer
from favor.models.decoder import Decoder
from favor.models.vit import ViT
from favor.registry import Registry

DTYPES = ("float32", "bfloat16", "float16")


FAMILIES = Registry("model", {"bert": Bert, "vit": ViT, "conformer": Conformer, "decoder": Decoder})
names = FAMILIES.names


def preset_names(name: str) -> tuple[str, ...]:
    FAMILIES.lookup(name)
    return tuple(presets.PRESETS[name])


def _dtype(key, value):
    name = jnp.dtype(value).name if not isinstance(value, str) else value
    if name not in DTYPES:
        raise ValueError(f"{key} must be one of {', '.join(DTYPES)}; got {value!r}")
    return jnp.dtype(name)


def config(name: str, preset: str = "tiny", **overrides) -> dict[str, Any]:
    """The full keyword set a model is built from: family defaults < preset < overrides."""
    FAMILIES.lookup(name)
    c = presets.sizes(name, preset)
    unknown = sorted(set(overrides) - set(c))
    if unknown:
        raise ValueError(f"unknown {name} option(s) {', '.join(map(repr, unknown))}; valid: {', '.join(sorted(c))}")
    c.update(overrides)
    # unknown attention options fail here, naming the valid ones (the kind's, and the layer's qk_norm)
    try:
        kind, options, qk = attention_lib.read_block(c["attention"], from_config=False)
    except attention_lib.BlockError as e:
        raise ValueError(f"{name}: attention: {e}") from None
    c["attention"] = {"kind": kind, **options, **qk}
    c["dtype"], c["param_dtype"] = _dtype("dtype", c["dtype"]), _dtype("param_dtype", c["param_dtype"])
    return c


def get(name: str, preset: str = "tiny", *, rngs: nnx.Rngs | None = None, **overrides) -> nnx.Module:
    """Build model `name` ("bert", "vit", "conformer", "decoder") at `preset` with `overrides`.

    rngs streams: "params" (weights), "dropout", "features" (the random projections, kept as
    FeatureDraw state); one seed `nnx.Rngs(0)` serves all three."""
    c = config(name, preset, **overrides)
    return FAMILIES.lookup(name)(rngs=rngs if rngs is not None else nnx.Rngs(0), **c)


def param_count(model: nnx.Module) -> int:
    return sum(int(v.size) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
