"""The one check of a whole config before a run builds anything, loading config files, and dotted overrides.

    python train.py --config configs/<file>.py:data=local,kind=favor#,runlocal ...

    configlib.validate(c)     # ConfigError naming the key, the value and what is allowed

What configs are written with (parse_arg, run_config, optim, attention, ...) is favor.configbase's, which
imports no JAX; it is re-exported here for the tools that build configs.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import jax

from favor import attention as attention_lib
from favor import data, models, sharding, strings, tasks, uptrain
from favor.train import optim as optim_lib
from favor.sharding import MESH_AXES

# the helpers configs are written with, for the tools that build or change configs
from favor.configbase import (OPTIM_DEFAULTS, OPTIM_OPTIONAL, apply_flag, attention, choice,  # noqa: F401
                              missing_key, optim, parse_arg, run_config, values)

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
    try:
        kind, options, qk = attention_lib.read_block(m.attention, from_config=True)
    except attention_lib.BlockError as e:
        if e.key == "kind":
            raise ConfigError("model.attention.kind", e.value, f"must be one of {', '.join(attention_lib.names())}") \
                from None
        raise ConfigError("model.attention" + (f".{e.key}" if e.key else ""), e.value, str(e)) from None
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
    d["attention"] = {"kind": kind, **options, **qk}
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
