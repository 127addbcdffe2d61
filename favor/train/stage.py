"""Stages: phases at the start of a run, each with its own loss, optimizer and train-state entries, run
before the main training. Attention transfer (favor.uptrain.transfer) is one.

The loop knows a stage only through this record: the train state gains the stage's entries (made from
the parameters the run starts from, after `init_from`) and its optimizer state; steps 0 … steps − 1 run
`favor.train.steps.stage_step` on its loss (the training step's guard against non-finite updates
included); its evaluation, if it has one, is recorded at its first and last step. Stages run in order,
then the main training takes the remaining steps, its learning-rate schedule starting where they end.
A new stage (a distillation, a window-growth schedule) is one module that returns a Stage.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optax


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str                      # metrics "<name>/…"; its optimizer state is the entry "<name>_opt_state"
    steps: int                     # how many steps it runs
    tx: optax.GradientTransformation
    # (params, rest, entries, batch, *, graphdef, task) -> (loss, {metric: value}): differentiated in params
    loss: Callable
    # params -> {key: tree shaped like params}: the stage's own train-state entries (sharded as the params)
    entries: Callable[[dict], dict]
    entry_keys: tuple[str, ...]
    # (params, rest, entries, batch, *, graphdef, task) -> (values [K], weight): averaged over the eval
    # split with those weights; None: the stage has no evaluation
    evaluate: Callable | None = None
    eval_name: str = ""            # TensorBoard: "<name>/eval_<eval_name>_<k>"
    summary_key: str = ""          # summary.json: {step: [K values]}
    describe: str = ""             # the log line's words for the K values
    trainable: Any = None          # a bool per parameter leaf: what the stage trains (None: all)

    @property
    def opt_key(self) -> str:
        return f"{self.name}_opt_state"


def spans(stages) -> list[tuple[Stage, int, int]]:
    """(stage, first step, end step) of each stage, one after another from step 0."""
    out, first = [], 0
    for s in stages:
        out.append((s, first, first + s.steps))
        first += s.steps
    return out


def main_start(stages) -> int:
    """The step the main training starts at (every stage's steps before it)."""
    return sum(s.steps for s in stages)
