"""What every configs/*.py shares, and the one check of a whole config before a run builds anything.

    python train.py --config configs/<file>.py:data=local,kind=favor#,runlocal ...

    args = configlib.parse_arg(arg, runlocal=False, kind="favor++", steps=0)   # typed by the defaults
    c = configlib.run_config(total_steps=..., batch_size=..., eval_batch_size=..., every=...)
    c.optim = configlib.optim(lr=1e-4, schedule="linear", warmup_steps=10_000, weight_decay=0.01)
    configlib.validate(c)     # ConfigError naming the key, the value and what is allowed
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import jax
import ml_collections

from favor import attention as attention_lib
from favor import data, models, sharding, strings, tasks, uptrain
from favor.train import optim as optim_lib
from favor.attention import qknorm, schedule
from favor.sharding import DEFAULT_RULES, MESH_AXES

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
    """A sweep arg's list: "softmax/favor+/favor++" -> ("softmax", "favor+", "favor++"). The separator is
    "/" because "," separates the args themselves and "+" is part of kind names (favor+, favor++). A value
    outside `allowed` (when given) is a ValueError listing the valid ones."""
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
    c.mesh = {"data": -1, "fsdp": 1, "tensor": 1}
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
                 "lora_targets": models.lora.DEFAULT_TARGETS, "lora_also": "", "finetune": "all"}
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
        raise ValueError(f"configlib.optim: unknown key(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
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
            **{k: "" for k in attention_lib.SPEC_OPTIONS}, **qknorm.OPTIONS, **options}


# -- loading a config file -----------------------------------------------------------------------------
def load(spec: str):
    """The config of "path/to/file.py[:arg]", as `--config` loads it (not locked); for tools that need a
    config outside train.py's flags (the sweep launcher, train.py's error messages)."""
    path, arg = strings.config_spec(spec)
    module = load_module(path)
    return module.get_config(arg) if arg else module.get_config()


def load_module(path: str):
    module_spec = importlib.util.spec_from_file_location(f"favor_config_{Path(path).stem}", path)
    if module_spec is None or not Path(path).is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


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


# -- validation ------------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """A config value that is not allowed: `config.<key>=<value>: <what is allowed>`."""

    def __init__(self, key: str, value, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config.{key}={value!r}: {allowed}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(c, key, minimum):
    v = get(c, key)
    if not _is_int(v) or v < minimum:
        raise ConfigError(key, v, "must be a positive integer" if minimum == 1 else f"must be an integer ≥ {minimum}")
    return v


def _number(c, key, ok, what):
    v = get(c, key)
    if not _is_number(v) or not math.isfinite(v) or not ok(v):
        raise ConfigError(key, v, what)
    return float(v)


def _one_of(c, key, allowed):
    v = get(c, key)
    if v not in allowed:
        raise ConfigError(key, v, f"must be one of {', '.join(map(str, allowed))}")
    return v


def get(c, key: str):
    """config.<key> for a dotted key ("optim.lr")."""
    node = c
    for part in key.split("."):
        node = node[part]
    return node


def validate(config) -> None:
    """Check every key a run reads, before anything is built or compiled; the first bad one is a
    ConfigError `config.<key>=<value>: <what is allowed>`. Types and ranges of the run keys here; names
    and options of registered things (attention kind, dataset, task, model) through their registries,
    whose errors name the valid choices."""
    required = ("seed", "total_steps", "batch_size", "eval_batch_size", "checkpoint_every", "eval_every", "log_every",
                "keep_checkpoints", "mesh", "data", "task", "model", "optim")
    missing = [k for k in required if k not in config]
    if missing:
        raise ConfigError(missing[0], None, "is required (every configs/*.py sets it through configlib.run_config)")
    _int(config, "seed", 0)
    _int(config, "total_steps", 0)
    for key in ("checkpoint_every", "eval_every", "log_every", "keep_checkpoints"):
        _int(config, key, 1)
    if "prefetch" in config:
        _int(config, "prefetch", 0)

    # mesh, then the batch sizes it must divide
    mesh_spec = dict(config.mesh)
    for axis, n in mesh_spec.items():
        if axis not in MESH_AXES:
            raise ConfigError(f"mesh.{axis}", n, f"unknown mesh axis {axis!r}; valid: {', '.join(MESH_AXES)}")
        if not _is_int(n) or (n < 1 and n != -1):
            raise ConfigError(f"mesh.{axis}", n, "must be a positive integer, or -1 for the devices the other "
                                                 "axes leave")
    try:
        sizes = sharding.mesh_shape(mesh_spec, jax.device_count())
    except ValueError as e:
        # name the axis when one alone departs from the default layout (the one the user set)
        named = [a for a, n in mesh_spec.items() if n not in (1, -1)]
        key, value = (f"mesh.{named[0]}", mesh_spec[named[0]]) if len(named) == 1 else ("mesh", mesh_spec)
        raise ConfigError(key, value, str(e)) from None
    rules = dict(config.get("sharding_rules", {}))
    for name, axis in rules.items():
        if axis is not None and axis not in MESH_AXES:
            raise ConfigError(f"sharding_rules.{name}", axis, f"must be a mesh axis ({', '.join(MESH_AXES)}) or None")
    accumulate = _validate_optim(config)
    dp, procs = sizes["data"] * sizes["fsdp"], jax.process_count()
    for key in ("batch_size", "eval_batch_size"):
        v = get(config, key)
        if not _is_int(v) or v < 1 or v % dp or v % procs:
            procs_too = f" and by the {procs} processes" if procs > 1 else ""
            raise ConfigError(key, v, f"must be a positive integer divisible by the number of data-parallel "
                                      f"devices ({dp}){procs_too}")
    per_device = config.batch_size // dp
    if per_device % accumulate:       # each microbatch is split over the data-parallel devices too
        raise ConfigError("optim.accumulate_steps", accumulate, f"must divide the per-device batch "
                                                                f"(batch_size / {dp} devices = {per_device})")

    _validate_model(config)
    _validate_uptrain(config)
    for key, module in (("data", data), ("task", tasks)):
        name = dict(config[key]).get("name")
        if name not in module.names():
            raise ConfigError(f"{key}.name", name, f"must be one of {', '.join(module.names())}")
        try:
            module.check(config[key])           # option names (values: the source or task checks them)
        except ValueError as e:
            raise ConfigError(key, dict(config[key]), str(e)) from None


def _validate_optim(config) -> int:
    o = "optim."
    _one_of(config, o + "name", optim_lib.OPTIMIZERS)
    _one_of(config, o + "schedule", optim_lib.SCHEDULES)
    _number(config, o + "lr", lambda v: v > 0, "must be a finite number > 0")
    _int(config, o + "warmup_steps", 0)
    _number(config, o + "weight_decay", lambda v: v >= 0, "must be a finite number ≥ 0")
    _number(config, o + "clip_norm", lambda v: v >= 0, "must be a finite number ≥ 0 (0: no clipping)")
    _number(config, o + "layer_decay", lambda v: 0 < v <= 1, "must be in (0, 1] (1: off)")
    for key in ("b1", "b2"):
        _number(config, o + key, lambda v: 0 <= v < 1, "must be in [0, 1)")
    _number(config, o + "eps", lambda v: v > 0, "must be a finite number > 0")
    if "end_lr_factor" in config.optim:
        _number(config, o + "end_lr_factor", lambda v: 0 <= v <= 1, "must be in [0, 1]")
    if "momentum" in config.optim:
        _number(config, o + "momentum", lambda v: 0 <= v < 1, "must be in [0, 1)")
    unknown = sorted(set(config.optim) - set(OPTIM_DEFAULTS) - set(OPTIM_OPTIONAL))
    if unknown:
        raise ConfigError(o + unknown[0], config.optim[unknown[0]], f"is not an optimizer key; valid: "
                          f"{', '.join([*OPTIM_DEFAULTS, *OPTIM_OPTIONAL])}")
    return _int(config, o + "accumulate_steps", 1)


def _validate_model(config) -> None:
    m = config.model
    for key in ("dtype", "param_dtype"):
        if key in m:
            _one_of(config, f"model.{key}", models.DTYPES)
    block = dict(m.attention)
    kind = block.get("kind")
    if kind not in attention_lib.names():
        raise ConfigError("model.attention.kind", kind, f"must be one of {', '.join(attention_lib.names())}")
    if block.get("redraw"):
        try:
            schedule.parse(block["redraw"])
        except ValueError:
            raise ConfigError("model.attention.redraw", block["redraw"], f"must be {schedule.HELP}") from None
    options = attention_lib.block_options(block)
    try:
        options, qk = qknorm.split(options)
    except qknorm.OptionError as e:        # the layer's query/key normalisation, named by its key
        raise ConfigError(f"model.attention.{e.key}", options.get(e.key), str(e)) from None
    try:
        attention_lib.get(**options)
    except (TypeError, ValueError) as e:
        # the kind's message names the problem; the option that fails alone is the key to report
        alone = [k for k in options if k != "kind" and _fails(attention_lib, kind, k, options[k])]
        key = f"model.attention.{alone[0]}" if alone else "model.attention"
        raise ConfigError(key, options[alone[0]] if alone else block, str(e)) from None
    spec = str(m.get("init_from", "") or "")
    if spec:
        try:
            uptrain.parse(spec)
        except ValueError as e:
            raise ConfigError("model.init_from", spec, f"must be '' (fresh weights) or name a source: {e}") from None
    d = m.to_dict()
    name, preset = d.pop("name", None), d.pop("preset", "tiny")
    d.pop("init_from", None)
    if name not in models.names():
        raise ConfigError("model.name", name, f"must be one of {', '.join(models.names())}")
    if preset not in models.preset_names(name):
        raise ConfigError("model.preset", preset, f"must be one of {', '.join(models.preset_names(name))}")
    for key, v in d.items():
        # every integer a model takes is a size or count (hidden, heads, layers, vocab, patches, ...);
        # a model of no layers is a baseline without attention (configs/listops.py:bag)
        if _is_int(v) and v < (0 if key == "num_layers" else 1):
            raise ConfigError(f"model.{key}", v, "must be a non-negative integer" if key == "num_layers"
                              else "must be a positive integer")
        if key.endswith("dropout") and not (_is_number(v) and 0 <= v < 1):
            raise ConfigError(f"model.{key}", v, "must be in [0, 1)")
    d["attention"] = options
    try:       # the rest (unknown keys, value choices): the model zoo's own check, which builds nothing
        models.config(name, preset, **d)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError("model", f"{name}/{preset}", str(e)) from None


FINETUNE = ("all", "lora")


def uses_lora(uptrain) -> bool:
    """Whether a run with `uptrain` (config.uptrain) carries LoRA adapters: trainable="lora" (both stages)
    or finetune="lora" (the training after the transfer stage)."""
    return uptrain.get("trainable") == "lora" or uptrain.get("finetune", "all") == "lora"


def _validate_uptrain(config) -> None:
    if "uptrain" not in config:
        return
    _int(config, "uptrain.transfer_steps", 0)
    steps = config.uptrain.transfer_steps
    if steps and not config.model.get("init_from"):
        raise ConfigError("uptrain.transfer_steps", steps, "needs model.init_from (the transfer stage's teacher "
                                                           "is the model the run starts from); 0 without one")
    if steps > config.total_steps:
        raise ConfigError("uptrain.transfer_steps", steps, f"must be at most total_steps ({config.total_steps})")
    if steps and config.model.attention.kind == "softmax":
        raise ConfigError("uptrain.transfer_steps", steps, "a softmax model is its own teacher: 0 for attention "
                                                           "kind softmax")
    _number(config, "uptrain.lr", lambda v: v > 0, "a positive number")
    pattern = get(config, "uptrain.trainable")
    try:
        re.compile(str(pattern))
    except re.error as e:
        raise ConfigError("uptrain.trainable", pattern, f"must be 'query_key', 'all', 'feature_maps', 'lora' or a "
                                                       f"regular expression over parameter paths ({e})") from None
    finetune = get(config, "uptrain.finetune") if "finetune" in config.uptrain else "all"
    if finetune not in FINETUNE:
        raise ConfigError("uptrain.finetune", finetune, f"must be one of {', '.join(map(repr, FINETUNE))} (what the "
                                                        "training after the transfer stage trains)")
    if pattern != "lora" and finetune != "lora":
        return
    key, value = ("uptrain.trainable", pattern) if pattern == "lora" else ("uptrain.finetune", finetune)
    if not config.model.get("init_from"):
        raise ConfigError(key, value, "needs model.init_from: LoRA freezes the weights the run "
                                      "starts from, and a model from scratch has none worth keeping")
    _int(config, "uptrain.lora_rank", 1)
    _number(config, "uptrain.lora_alpha", lambda v: v > 0, "a positive number")
    for key in ("uptrain.lora_targets", "uptrain.lora_also"):
        try:
            re.compile(str(get(config, key)))
        except re.error as e:
            raise ConfigError(key, get(config, key), f"must be a regular expression over dotted paths ({e})") from None


def _fails(attention_lib, kind, key, value) -> bool:
    try:
        attention_lib.get(kind, **{key: value})
    except (TypeError, ValueError):
        return True
    return False


def describe_type(value: Any) -> str:
    """What a value of the type of `value` is, in words (for flag errors)."""
    if isinstance(value, bool):
        return "True or False"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, (tuple, list)):
        return "a tuple, e.g. '(1, 2)'"
    return f"a {type(value).__name__}"
