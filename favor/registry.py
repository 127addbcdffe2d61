"""Building registered things from the strings users type, with errors that list what is valid."""

from __future__ import annotations


def build(what: str, registry: dict, name: str, options: dict):
    """registry[name](**defaults, **options); an unknown name or option is a ValueError naming it."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(registry)}")
    cls = registry[name]
    bad = sorted(set(options) - set(cls.OPTIONS))
    if bad:
        valid = ", ".join(f"{k}={v!r}" for k, v in cls.OPTIONS.items()) or "none"
        raise ValueError(f"{what} {name!r} got unknown option(s) {', '.join(map(repr, bad))}; "
                         f"valid options: {valid}")
    return cls(**{**cls.OPTIONS, **options})
