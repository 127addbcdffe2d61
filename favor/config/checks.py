"""The typed checks every package's config block is checked with, and the one error they raise:
`config.<key>=<value>: <what is allowed>`. Pure Python (no JAX), so a package's `check(config)` can use
them without an import of the stack: favor.job composes those checks into one before a run builds
anything."""

from __future__ import annotations

import math
import re


class UsageError(ValueError):
    """An input the user gave that a run cannot take (a config value, a run directory, a checkpoint of
    another model): its message is the whole story, so train.py prints it as one line and exits 2."""


class ConfigError(UsageError):
    """A config value that is not allowed: `config.<key>=<value>: <what is allowed>`."""

    def __init__(self, key: str, value, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config.{key}={value!r}: {allowed}")


def get(c, key: str):
    """config.<key> for a dotted key ("optim.lr")."""
    node = c
    for part in key.split("."):
        node = node[part]
    return node


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(c, key, minimum):
    """config.<key> as an integer ≥ `minimum`."""
    v = get(c, key)
    if not is_int(v) or v < minimum:
        raise ConfigError(key, v, "must be a positive integer" if minimum == 1 else f"must be an integer ≥ {minimum}")
    return v


def number(c, key, ok, what):
    """config.<key> as a finite number for which `ok` holds (`what` says which)."""
    v = get(c, key)
    if not is_number(v) or not math.isfinite(v) or not ok(v):
        raise ConfigError(key, v, what)
    return float(v)


def one_of(c, key, allowed):
    v = get(c, key)
    if v not in allowed:
        raise ConfigError(key, v, f"must be one of {', '.join(map(str, allowed))}")
    return v


def regex(c, key, what):
    """config.<key> as a regular expression (`what`: what it must be, for the error)."""
    v = get(c, key)
    try:
        re.compile(str(v))
    except re.error as e:
        raise ConfigError(key, v, f"{what} ({e})") from None
    return v


def describe_type(value) -> str:
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
