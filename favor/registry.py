"""Registered things built from the strings users type, with errors that list what is valid.

A registry is a dict from name to a class, or to "module:Class" (imported only when named, which keeps
TF-heavy pipelines out of runs that do not use them). Each class lists its options and their defaults
in `OPTIONS`. The packages keyed by config blocks, favor.data and favor.tasks, offer the same three
functions over theirs: `names()`, `get(block)` and `check(block)` (get's errors, building nothing);
favor.attention and favor.kernels call `build` with keyword options.
"""

from __future__ import annotations

import importlib


def lookup(what: str, registry: dict, name: str):
    """The class registered as `name`; an unknown name is a ValueError listing the valid ones."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(registry)}")
    cls = registry[name]
    if isinstance(cls, str):
        module, _, attr = cls.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    return cls


def check(what: str, registry: dict, name: str, options: dict):
    """`lookup`, and every option name checked against the class's OPTIONS (values are the class's to
    check when built). Returns the class."""
    cls = lookup(what, registry, name)
    bad = sorted(set(options) - set(cls.OPTIONS))
    if bad:
        valid = ", ".join(f"{k}={v!r}" for k, v in cls.OPTIONS.items()) or "none"
        raise ValueError(f"{what} {name!r} got unknown option(s) {', '.join(map(repr, bad))}; "
                         f"valid options: {valid}")
    return cls


def build(what: str, registry: dict, name: str, options: dict):
    """registry[name](**defaults, **options); an unknown name or option is a ValueError naming it."""
    cls = check(what, registry, name, options)
    return cls(**{**cls.OPTIONS, **options})


def split_block(block) -> tuple[str | None, dict]:
    """A config block {"name": ..., **options} -> (name, options)."""
    options = dict(block)
    return options.pop("name", None), options
