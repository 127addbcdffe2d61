"""What configs/*.py are written with, importing no JAX: the arg string after a config's file name, the
run-loop, optimizer and attention blocks, and one dotted override. Writing or printing a config reads
only this module (and favor.strings, favor.config.presets); checking one before a run is favor.config.loading's.

    args = blocks.parse_arg(arg, runlocal=False, kind="favor++", steps=0)   # typed by the defaults
    c = blocks.run_config(total_steps=..., batch_size=..., eval_batch_size=..., every=...)
    c.optim = blocks.optim(lr=1e-4, schedule="linear", warmup_steps=10_000, weight_decay=0.01)

The blocks' default keys live here, and the modules that read them import them from here (the sharding
rules, LoRA's targets, the query/key normalisation options); the attention kinds' spec options are
checked against the kinds themselves by a test.
"""

from __future__ import annotations

import difflib

import ml_collections

from favor import strings

# the sharding rules' defaults (favor.sharding reads them): logical axis -> mesh axis
DEFAULT_RULES = {"vocab": "tensor", "embed": "fsdp", "heads": "tensor", "mlp": "tensor", "kernel": None,
                 "classes": None}
# the projections LoRA adapts by default (favor.models.lora): LoLCATs' q, k, v, o of every attention block
LORA_TARGETS = r"(^|\.)attention\.(query|key|value|out)$"
# the layer's query/key normalisation options (favor.attention.qknorm)
QK_NORM_OPTIONS = {"qk_norm": "", "qk_radius": 1.0, "qk_radius_max": 2.0}
# the options a kind spec's variant sets (kind:variant), one per kind that has one
SPEC_OPTIONS = ("variant", "lambda_", "features")
# attention kinds whose feature maps are trained parameters (favor.attention.kinds.LearnedAttention)
LEARNED_KINDS = ("hedgehog", "t2r")


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


# -- the arg string after the config file's name ------------------------------------------------------
def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """"a=1,b,c=x" -> a ConfigDict with every key of `defaults`, each value converted to its default's type
    (big_vision's style): bool from "True"/"False"/"1"/"0"/"yes"/"no" (a bare "b" is True), int, float, or
    str. A key outside `defaults`, or a value that does not convert, is a ValueError naming it."""
    out = dict(defaults)
    for part in filter(None, (p.strip() for p in (arg or "").split(","))):
        key, has_value, value = (s.strip() for s in part.partition("="))
        if key not in defaults:
            valid = ", ".join(f"{k}={v!r}" for k, v in defaults.items()) or "none"
            raise ValueError(f"unknown arg {key!r}; valid (with defaults): {valid}")
        out[key] = _convert(key, value if has_value else None, defaults[key])
    return ml_collections.ConfigDict(out)


def _convert(key: str, value: str | None, default):
    if isinstance(default, bool):          # before int: bool is an int subclass
        if value is None or value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ValueError(f"config arg {key}={value!r}: expected True or False (or 1/0)")
    if value is None:
        raise ValueError(f"config arg {key!r} needs a value ({key}=...; default {default!r})")
    for kind, name in ((int, "an integer"), (float, "a number")):
        if isinstance(default, kind):
            try:
                return kind(value)
            except ValueError:
                raise ValueError(f"config arg {key}={value!r}: expected {name}") from None
    return value


def values(name: str, text: str, allowed=None) -> tuple:
    """A sweep arg's list: "softmax/favor+/favor++" -> ("softmax", "favor+", "favor++") (favor.strings.choices:
    "/" in a config's arg, where "," separates the args themselves). A value outside `allowed` (when given)
    is a ValueError listing the valid ones."""
    return strings.choices(name, text, allowed)


def choice(name: str, value: str, allowed) -> str:
    """`value` if it is one of `allowed`, else a ValueError listing them."""
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(map(str, allowed))}")
    return value


# -- shared blocks ----------------------------------------------------------------------------------
def run_config(*, total_steps: int, batch_size: int, eval_batch_size: int, every: int, log_every: int = 100,
               keep_checkpoints: int = 2, seed: int = 0) -> ml_collections.ConfigDict:
    """The run-loop keys (checkpoints and evals every `every` steps; the mesh all data-parallel)."""
    c = ml_collections.ConfigDict()
    c.seed = int(seed)
    c.total_steps, c.batch_size, c.eval_batch_size = int(total_steps), int(batch_size), int(eval_batch_size)
    c.checkpoint_every, c.eval_every, c.log_every = int(every), int(every), int(log_every)
    c.keep_checkpoints = int(keep_checkpoints)
    # "sequence": devices the activations' length axis is split over (favor.attention.sequence)
    c.mesh = {"data": -1, "fsdp": 1, "sequence": 1, "tensor": 1}
    c.sharding_rules = dict(DEFAULT_RULES)
    c.prefetch = 2                     # host batches read ahead on a thread (0: read in the loop)
    # a run that starts from another model's parameters (model.init_from) may first train the model
    # around its attention to imitate that model's softmax attention (favor.uptrain.transfer)
    # trainable="lora": rank-`lora_rank` adapters scaled by lora_alpha / lora_rank on the projections
    # `lora_targets` selects (favor.models.lora; LoLCATs: rank 8 on q, k, v, o), trained in the transfer
    # stage and the training after it with `lora_also` (a regular expression: new task heads), the rest frozen.
    # finetune: what the training after the transfer stage trains, "all" or "lora" (LoLCATs' recipe:
    # trainable="feature_maps" in the transfer stage, then finetune="lora"); trainable="lora" implies "lora"
    c.uptrain = {"transfer_steps": 0, "trainable": "query_key", "lr": 1e-3, "lora_rank": 8, "lora_alpha": 16.0,
                 "lora_targets": LORA_TARGETS, "lora_also": "", "finetune": "all"}
    return c


OPTIM_DEFAULTS = dict(name="adamw", lr=1e-3, schedule="cosine", warmup_steps=0, weight_decay=0.0, clip_norm=1.0,
                      layer_decay=1.0, b1=0.9, b2=0.999, eps=1e-8, accumulate_steps=1, end_lr_factor=0.0)
OPTIM_OPTIONAL = {"momentum": 0.9}     # sgd only: present when a config sets it
_INT_OPTIM = ("warmup_steps", "accumulate_steps")


def optim(**overrides) -> ml_collections.ConfigDict:
    """The `config.optim` block (favor.train.optim reads it): OPTIM_DEFAULTS with `overrides`.

    Numbers are stored as float or int by key, whatever the caller wrote (`lr=1` is 1.0): a locked
    config types each field by its value, and `--config.optim.lr=0.5` must parse against a float."""
    valid = {**OPTIM_DEFAULTS, **OPTIM_OPTIONAL}
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"loading.optim: unknown key(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    o = {**OPTIM_DEFAULTS, **overrides}
    for k, v in o.items():
        o[k] = int(v) if k in _INT_OPTIM else float(v) if isinstance(valid[k], float) else v
    return ml_collections.ConfigDict(o)


def attention(kind: str, num_features: int, redraw: str = "", **options) -> dict:
    """The `config.model.attention` block. It carries the random-feature options (so that
    `--config.model.attention.kind=softmax` is a plain override; options a kind does not take are dropped
    by `favor.attention.block_options`), the layer's query/key normalisation (favor.attention.qknorm, every
    kind), and `coupling=""`, `redraw=""`, `impl=""` (auto: favor.attention.IMPLS) and the kind specs' options (`variant`, `lambda_`, `features`) at "",
    which mean the kind's own (coupling: orthogonal, or simplex for simrf; redraw:
    `favor.attention.block_redraw`; variant: FAVOR#'s SDERF): a locked config refuses to override a key it
    lacks, so the keys must exist (a sweep sets `--config.model.attention.variant=saderf` on its FAVOR#
    runs), but a value here would override every kind's own (an "orthogonal" here would make simrf run
    FAVOR+)."""
    return {"kind": kind, "num_features": int(num_features), "coupling": "", "redraw": redraw, "window": 0,
            "window_mix": "shared", "impl": "",
            **{k: "" for k in SPEC_OPTIONS}, **QK_NORM_OPTIONS, **options}


def missing_key(config, path: str) -> str | None:
    """Why `config.<path>` does not exist, naming the keys that do (None if it exists)."""
    node, walked = config, "config"
    for part in path.split("."):
        keys = list(node.keys()) if hasattr(node, "keys") else None
        if keys is None:
            return f"{walked} is a {type(node).__name__}, not a block of keys"
        if part not in keys:
            close = difflib.get_close_matches(part, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"{walked} has no key {part!r}{hint}; its keys: {', '.join(sorted(keys))}"
        node, walked = node[part], f"{walked}.{part}"
    return None


def apply_flag(config, flag: str) -> None:
    """Apply one command-line style override "--config.key=value" (or "key=value") to `config`, the value
    typed by the key's current value as train.py's flags are; a key the config lacks is a ValueError
    naming the keys there are. For tools that build configs outside train.py's flags."""
    key, _, value = flag.removeprefix("--config.").partition("=")
    problem = missing_key(config, key)
    if problem:
        raise ValueError(f"--config.{key}: {problem}")
    node = config
    *path, last = key.split(".")
    for part in path:
        node = node[part]
    with config.unlocked():
        node[last] = _convert(key, value, node[last])
