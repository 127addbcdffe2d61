"""Sweeps: a config's `sweep()` as a list of named runs, and the helper sweeps are written with.

    # configs/<name>.py
    def sweep(arg=None):
        yield from sweeps.product({"model.attention.kind": KINDS, "seed": (0, 1)})

Each item is an override dict ({"model.attention.kind": "favor#", "seed": 1}); a run gets
`--config.<key>=<value>` flags and a workdir named after its overrides (`kind=favor#_seed=1`).
launch/sweep_local.py runs them here, launch/slurm_gpu.sbatch as an array job, launch/tpu_pod.sh on a
pod; `python -m favor.tools.report <sweep dir>` compares them.
"""

from __future__ import annotations

import inspect
import itertools
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

from favor import attention, strings
from favor.config import loading

# Keys that only pick a random stream: runs that differ in these alone are repeats of one setting
# (favor.tools.report averages them).
SEED_KEYS = ("seed",)


def product(axes: Mapping[str, Sequence]) -> Iterator[dict]:
    """Every combination of the axes' values, the first axis varying slowest:
    product({"a": (1, 2), "seed": (0, 1)}) -> {a: 1, seed: 0}, {a: 1, seed: 1}, {a: 2, seed: 0}, ..."""
    keys = list(axes)
    for key in keys:
        if isinstance(axes[key], (str, bytes)) or not isinstance(axes[key], Sequence) or not axes[key]:
            raise ValueError(f"sweep axis {key!r}: expected a non-empty list or tuple of values, got {axes[key]!r}")
    for values in itertools.product(*(axes[k] for k in keys)):
        yield dict(zip(keys, values))


def seed_by_seed(settings: Iterable[Mapping], seeds: Sequence[int]) -> Iterator[dict]:
    """Each setting with `seed`, the seed varying slowest: every setting has a run before any has two, and
    the runs a parallel sweep starts together are different programs, so a setting's later seeds find
    its programs compiled (launch/sweep_local.py's cache) rather than compiling them side by side."""
    settings = [dict(s) for s in settings]
    for seed in seeds:
        for setting in settings:
            yield {**setting, "seed": seed}


def kind_settings(name: str, text: str) -> list[dict]:
    """A sweep arg's list of kind specs (`kind[:variant][@window]`, favor.attention.parse_spec) as override
    dicts: "favor+/favor#:saderf" -> [{"model.attention.kind": "favor+"}, {"model.attention.kind": "favor#",
    "model.attention.variant": "saderf"}]. An unknown kind or a bad variant is a ValueError naming it."""
    return [{"model.attention.kind": kind, **{f"model.attention.{k}": v for k, v in options.items()}}
            for _, kind, options in attention.parse_specs(name, text)]


def as_advised(setting: Mapping) -> dict:
    """`setting` with queries and keys on the sphere (`qk_norm=l2`) when its kind is sign-indefinite (trig,
    HRF) and it sets no qk_norm of its own: the way favor advises running them (favor.job warns without it:
    their denominators near zero at unnormalised norms, the model barely learns)."""
    setting = dict(setting)
    kind = setting.get("model.attention.kind")
    if kind and "model.attention.qk_norm" not in setting and not getattr(attention.get(kind), "positive", True):
        setting["model.attention.qk_norm"] = "l2"
    return setting


def is_seed_key(key: str) -> bool:
    return key.split(".")[-1] in SEED_KEYS


@dataclass(frozen=True)
class Run:
    index: int
    name: str
    overrides: dict

    def flags(self) -> list[str]:
        return [f"--config.{k}={v}" for k, v in self.overrides.items()]


def run_name(overrides: Mapping, short: Mapping[str, str] | None = None) -> str:
    """`kind=favor#_seed=1`: each key by its last part (the whole dotted key where two keys share it), an
    empty value as "none", characters a directory name should not hold replaced by '-'."""
    short = short or {k: k.split(".")[-1] for k in overrides}
    name = "_".join(f"{short[k]}={v if v != '' else 'none'}" for k, v in overrides.items()) or "base"
    return re.sub(r"[^A-Za-z0-9=._+#-]", "-", name)


def runs(items: Sequence[Mapping]) -> list[Run]:
    """The sweep's items as runs with distinct names; an item that is not a dict of dotted keys, or two
    items with the same overrides, is a ValueError naming it."""
    items = list(items)
    for i, item in enumerate(items):
        if not isinstance(item, Mapping) or not all(isinstance(k, str) and k for k in item):
            raise ValueError(f"sweep item {i}: expected a dict of config keys to values, got {item!r}")
    keys = list(dict.fromkeys(k for item in items for k in item))
    last = [k.split(".")[-1] for k in keys]
    short = {k: (k if last.count(k.split(".")[-1]) > 1 else k.split(".")[-1]) for k in keys}
    out, seen = [], {}
    for i, item in enumerate(items):
        name = run_name(item, short)
        if name in seen:
            raise ValueError(f"sweep items {seen[name]} and {i} are the same run ({name}); each item must differ")
        seen[name] = i
        out.append(Run(i, name, dict(item)))
    return out


def load(config: str) -> list[Run]:
    """The runs of `config` ("path.py" or "path.py:arg"): its module's sweep(), called with the arg when
    it takes one."""
    path, arg = strings.config_spec(config)
    module = loading.load_module(path)
    if not hasattr(module, "sweep"):
        raise ValueError(f"{path} has no sweep() function")
    takes_arg = bool(inspect.signature(module.sweep).parameters)
    if arg and not takes_arg:
        raise ValueError(f"{path}: sweep() takes no arg, but the config was given {arg!r}")
    return runs(module.sweep(arg or None) if takes_arg else module.sweep())
