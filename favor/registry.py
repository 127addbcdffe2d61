"""Building registered things from the strings users type, with errors that list what is valid."""

from __future__ import annotations


def build(what: str, registry: dict, name: str, options: dict):
    """registry[name](**defaults, **options) (a registry value is a class or "module:Class"); an unknown name or option is a ValueError naming it."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(registry)}")
    cls = registry[name]
    if isinstance(cls, str):          # "module:Class", imported only when named (keeps TF-heavy
        import importlib              # pipelines out of runs that do not use them)
        module, _, attr = cls.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    bad = sorted(set(options) - set(cls.OPTIONS))
    if bad:
        valid = ", ".join(f"{k}={v!r}" for k, v in cls.OPTIONS.items()) or "none"
        raise ValueError(f"{what} {name!r} got unknown option(s) {', '.join(map(repr, bad))}; "
                         f"valid options: {valid}")
    return cls(**{**cls.OPTIONS, **options})
