"""The model zoo by name: the families (BERT, ViT, Conformer, the decoder LM), their presets, and the checked keyword
set a model is built from."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from favor import attention as attention_lib
from favor.config import presets
from favor.config.checks import ConfigError, is_int, is_number, one_of
from favor.models.bert import Bert
from favor.models.conformer import Conformer
from favor.models import rope
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


def check(run) -> None:
    """`run.model` of a run's config (but `init_from`, the trainer's: favor.uptrain.check): the family, the preset, the
    dtypes, the attention block (favor.attention.read_block: one reading of it), sizes and dropout rates,
    and the rest as `config` builds it, which builds nothing. ConfigError naming the first bad key."""
    m = run.model
    for key in ("dtype", "param_dtype"):
        if key in m:
            one_of(run, f"model.{key}", DTYPES)
    try:
        kind, options, qk = attention_lib.read_block(m.attention, from_config=True)
    except attention_lib.BlockError as e:
        if e.key == "kind":
            raise ConfigError("model.attention.kind", e.value, f"must be one of {', '.join(attention_lib.names())}") \
                from None
        raise ConfigError("model.attention" + (f".{e.key}" if e.key else ""), e.value, str(e)) from None
    d = m.to_dict()
    name, preset = d.pop("name", None), d.pop("preset", "tiny")
    d.pop("init_from", None)
    if name not in names():
        raise ConfigError("model.name", name, f"must be one of {', '.join(names())}")
    if preset not in preset_names(name):
        raise ConfigError("model.preset", preset, f"must be one of {', '.join(preset_names(name))}")
    for key, v in d.items():
        # every integer a model takes is a size or count (hidden, heads, layers, vocab, patches, ...);
        # a model of no layers is a baseline without attention (configs/listops.py:bag)
        if is_int(v) and v < (0 if key == "num_layers" else 1):
            raise ConfigError(f"model.{key}", v, "must be a non-negative integer" if key == "num_layers"
                              else "must be a positive integer")
        if key.endswith("dropout") and not (is_number(v) and 0 <= v < 1):
            raise ConfigError(f"model.{key}", v, "must be in [0, 1)")
    if "rope_scaling" in d:
        try:
            rope.parse(d["rope_scaling"])
        except ValueError as e:
            raise ConfigError("model.rope_scaling", d["rope_scaling"], str(e)) from None
    d["attention"] = {"kind": kind, **options, **qk}
    try:
        config(name, preset, **d)          # the keyword set as a model is built from it
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError("model", f"{name}/{preset}", str(e)) from None
