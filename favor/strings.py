"""The string formats users type, one reader each: lists, lists of positive integers, config specs, and the
markers of generated Markdown sections.

Lists are "/"-separated in a config's arg (where "," separates the args themselves) and ","-separated on
the command line; every reader here takes either, since no list value favor reads (kind specs, names,
numbers) contains one. Pure Python, so configs and launch scripts read them without importing JAX.
"""

from __future__ import annotations

import re

_SEPARATORS = re.compile(r"[,/]")


def items(text) -> tuple[str, ...]:
    """"favor+/favor#" or "favor+,favor#" -> ("favor+", "favor#"): stripped, empty parts dropped, each value
    once, in the order given."""
    return tuple(dict.fromkeys(p.strip() for p in _SEPARATORS.split(str(text or "")) if p.strip()))


def choices(name: str, text, allowed=None, *, nonempty: bool = False) -> tuple[str, ...]:
    """`items(text)`, each one of `allowed` (when given); else a ValueError naming `name`, the bad values and
    the valid ones. `nonempty`: an empty list is an error too."""
    out = items(text)
    bad = [v for v in out if allowed is not None and v not in allowed]
    if bad or (nonempty and not out):
        valid = f"; valid: {'/'.join(map(str, allowed))}" if allowed is not None else ""
        raise ValueError(f"{name}: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'an empty list'}{valid}")
    return out


def positive_ints(name: str, text, *, nonempty: bool = True) -> list[int]:
    """"16/64/256" -> [16, 64, 256] in the order given; anything but positive integers (or, with
    `nonempty`, nothing at all) is a ValueError naming `name` and the text."""
    parts = items(text)
    if not all(p.isdigit() and int(p) > 0 for p in parts) or (nonempty and not parts):
        raise ValueError(f"{name} {text!r}: expected positive integers separated by '/' or ','")
    return [int(p) for p in parts]


def config_spec(spec) -> tuple[str, str]:
    """"configs/mqar.py:seeds=3,kinds=favor+" -> ("configs/mqar.py", "seeds=3,kinds=favor+"); "" when the spec
    has no arg. The arg is everything after the first ":" (a path never holds one here; args may)."""
    path, _, arg = str(spec).partition(":")
    return path, arg


def markers(name: str) -> tuple[str, str]:
    """The comment pair a generated section of a Markdown file sits between (BENCHMARKS.md's sections,
    README's guide)."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def between(text: str, name: str) -> str | None:
    """The body of section `name` in `text` (without its markers and surrounding newlines); None when the
    text lacks the section."""
    begin, end = markers(name)
    if begin not in text or end not in text:
        return None
    return text[text.index(begin) + len(begin):text.index(end)].strip("\n")


def replace_between(text: str, name: str, body: str) -> str | None:
    """`text` with section `name`'s body replaced by `body`; None when the text lacks the section."""
    begin, end = markers(name)
    if begin not in text or end not in text:
        return None
    return text[:text.index(begin)] + f"{begin}\n{body}\n{end}" + text[text.index(end) + len(end):]
