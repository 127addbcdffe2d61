"""The random-feature redraw schedule: the one place that reads `redraw` strings.

    sched = schedule.parse("every:100")
    sched.redraws            # False only for "fixed"
    sched.window(step)       # the index of the draw in force at `step` (step // N, or step)
    sched.key(base, step)    # base folded with that index: a resumed run draws what an
                             # uninterrupted one did

Strings: "step" (a fresh ω every call / training step), "every:N" (a fresh ω every N steps), "fixed"
(one ω for the whole run).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

HELP = "'step' (fresh ω from rng each call), 'every:N' (fresh ω every N steps) or 'fixed'"


@dataclasses.dataclass(frozen=True)
class Redraw:
    kind: str          # "step" | "every" | "fixed"
    every: int = 1

    @property
    def redraws(self) -> bool:
        return self.kind != "fixed"

    @property
    def needs_step(self) -> bool:
        return self.kind == "every"

    def window(self, step):
        """Which draw is in force at `step`."""
        return jnp.asarray(step) // self.every if self.kind == "every" else jnp.asarray(step)

    def key(self, base, step):
        """`base` folded with the draw index of `step` ("fixed": base itself)."""
        if self.kind == "fixed":
            return base
        return jax.random.fold_in(base, self.window(step))

    def __str__(self):
        return f"every:{self.every}" if self.kind == "every" else self.kind


def parse(spec) -> Redraw:
    """A schedule from the string users type; anything else is a ValueError listing the valid forms."""
    if isinstance(spec, Redraw):
        return spec
    if spec in ("step", "fixed"):
        return Redraw(spec)
    if isinstance(spec, str) and spec.startswith("every:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            n = 0
        if n >= 1:
            return Redraw("every", n)
    raise ValueError(f"unknown redraw {spec!r}; valid: {HELP}")
