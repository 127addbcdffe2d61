"""Registered things built from the strings users type, with errors that list what is valid.

One class serves every registry (kernel mechanisms, attention kinds, model families, datasets, tasks,
reproductions): a name maps to a class, or to "module:Class" / "module" (imported only when named,
which keeps TF-heavy pipelines out of runs that do not use them). Each class lists its options and
their defaults in `OPTIONS`. The packages keyed by config blocks ({"name": ..., **options}: favor.data,
favor.tasks) expose `names`, `get(block)` and `check(block)` (get's errors, building nothing).
"""

from __future__ import annotations

import importlib


class Registry:
    """`what` (how errors name an entry, e.g. "dataset") and the entries by name."""

    def __init__(self, what: str, entries: dict):
        self.what, self.entries = what, dict(entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def lookup(self, name: str):
        """The class (or module) registered as `name`; an unknown name is a ValueError listing the valid
        ones."""
        if name not in self.entries:
            raise ValueError(f"unknown {self.what} {name!r}; valid: {', '.join(self.entries)}")
        entry = self.entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = importlib.import_module(module)
            entry = getattr(entry, attr) if attr else entry
        return entry

    def check(self, name: str, options: dict):
        """`lookup`, and every option name checked against the class's OPTIONS (values are the class's to
        check when built). Returns the class."""
        cls = self.lookup(name)
        bad = sorted(set(options) - set(cls.OPTIONS))
        notes = getattr(cls, "option_note", lambda key: None)
        for key in bad:
            if notes(key):          # an option other entries take: say which, and why not this one
                raise ValueError(f"{self.what} {name!r}: {notes(key)}")
        if bad:
            valid = ", ".join(f"{k}={v!r}" for k, v in cls.OPTIONS.items()) or "none"
            raise ValueError(f"{self.what} {name!r} got unknown option(s) {', '.join(map(repr, bad))}; "
                             f"valid options: {valid}")
        return cls

    def build(self, name: str, **options):
        """entries[name](**defaults, **options); an unknown name or option is a ValueError naming it."""
        cls = self.check(name, options)
        return cls(**{**cls.OPTIONS, **options})

    def from_block(self, block):
        """The thing a config block {"name": ..., **options} names, built."""
        name, options = split_block(block)
        return self.build(name, **options)

    def check_block(self, block) -> None:
        """`from_block`'s errors, building nothing."""
        self.check(*split_block(block))


def split_block(block) -> tuple[str | None, dict]:
    """A config block {"name": ..., **options} -> (name, options)."""
    options = dict(block)
    return options.pop("name", None), options
