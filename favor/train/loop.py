"""The loop of a run: steps from where it starts to total_steps, the stages' steps first; logs, evals,
checkpoints, SIGTERM; the summary. favor.job builds what it runs (data, model, step functions, state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax

from favor.data import atomic
from favor.data.prefetch import prefetch
from favor.train.events import Progress, ScalarWriter
from favor.train.stage import Stage

log = logging.getLogger("favor.train")


class NonFiniteLoss(RuntimeError):
    """A step produced a non-finite loss, gradient or update; the message names the step."""


class Summary(dict):
    """What `run` returns and writes to summary.json; `.state` is the final train state (device
    arrays, kept out of the JSON). A dict, so callers that only read the metrics index it as before."""

    state: Any = None


@dataclasses.dataclass(frozen=True)
class StageRun:
    """A stage as the loop runs it: its steps [first, end), its jitted step and evaluation."""
    stage: Stage
    first: int
    end: int
    step_fn: Callable
    evaluate_fn: Callable | None = None       # state -> [K values] on the eval split


def check_finite(state, ckpt):
    bad = int(jax.device_get(state["bad_step"]))
    if bad >= 0:
        raise NonFiniteLoss(f"non-finite loss or gradient at step {bad}; stopped. The update of that step was "
                            f"not applied and no non-finite state was saved (last checkpoint: "
                            f"{ckpt.steps()[-1] if ckpt.steps() else 'none'})")


def save(ckpt, state, step: int, config, wall_seconds: float = 0.0):
    """Checkpoint `step`; `wall_seconds` (the run's time so far, all its processes) goes in the metadata
    so a resumed run's clock continues from it."""
    check_finite(state, ckpt)
    ckpt.save(step, state, {"step": step, "data_position": step, "config": config.to_json(),
                            "wall_seconds": wall_seconds})


@contextlib.contextmanager
def preemption():
    """An Event that SIGTERM sets while the loop runs (handlers can only be set from the main thread;
    elsewhere, e.g. a notebook's worker thread, the Event is never set)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


def num_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def trained_params(params, trainable) -> int:
    """How many parameters the main training trains (`trainable`: a bool per leaf, None: all)."""
    if trainable is None:
        return num_params(params)
    return int(sum(x.size for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(trainable)) if t))


def train_loop(config, workdir: Path, state, start: int, *, step_fn, evaluate_fn, ckpt, source, layout,
               t_start: float, stages: tuple[StageRun, ...] = (), eval_first: bool = False,
               trainable=None) -> Summary:
    """The steps from `start` to total_steps: each stage's own steps first (`stages`, in order), then
    `step_fn`'s; logs, evals, checkpoints, SIGTERM. `eval_first`: evaluate before the first step (a run
    that starts from another model's parameters: its day 0). `trainable`: what `step_fn` trains (a bool
    per parameter; None: all), counted in the log and the summary."""
    total, log_every, batch_size = int(config.total_steps), int(config.log_every), int(config.batch_size)
    writer = ScalarWriter(workdir / "tensorboard", enabled=jax.process_index() == 0)
    progress = Progress(num_train_steps=total, every_steps=log_every, writer=writer)
    batches = prefetch(source.train_batches(batch_size, start, int(config.seed)), int(config.get("prefetch", 2)))
    history = {"train_loss": None, "steps_per_second": None, "losses": [], "evals": []}
    stage_history = {run.stage.name: {} for run in stages}
    eval_metrics = {}
    total_params = num_params(state["params"])
    trained = trained_params(state["params"], trainable)
    log.info("training %d of %d parameters (%.3g %%)", trained, total_params, 100.0 * trained / max(total_params, 1))

    def record_eval(step):
        metrics = evaluate_fn(state)
        seconds = time.perf_counter() - t_start
        history["evals"].append({"step": step, "seconds": seconds, **metrics})
        # the run's own clock beside each eval (resumes included, gaps between them not): what
        # favor.tools.report plots the metric against, where TensorBoard's wall time would count the gaps
        writer.write_scalars(step, {**{f"eval/{k}": v for k, v in metrics.items()}, "time/wall_seconds": seconds})
        log.info("step %d eval %s", step, metrics)
        return metrics

    def record_stage(run, step):
        values = run.evaluate_fn(state)
        s = run.stage
        stage_history[s.name][str(step)] = values
        writer.write_scalars(step, {f"{s.name}/eval_{s.eval_name}_{i}": v for i, v in enumerate(values)})
        log.info("step %d %s: %s", step, s.describe, ", ".join(f"{v:.4g}" for v in values))

    def step_fn_at(step):
        return next((run.step_fn for run in stages if run.first <= step < run.end), step_fn)

    if start == 0 and eval_first:
        eval_metrics = record_eval(0)
    for run in stages:
        if run.evaluate_fn is not None and start == run.first:
            record_stage(run, start)
    with preemption() as stop:
        try:
            for step in range(start, total):
                state, metrics = step_fn_at(step)(state, layout.global_batch(next(batches)))
                done = step + 1
                last = done == total
                logging_step = done % log_every == 0 or last or stop.is_set()
                if logging_step:
                    check_finite(state, ckpt)
                    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                progress(done)
                if logging_step:
                    rate = progress.steps_per_second
                    if rate is not None:
                        m["examples_per_sec"] = rate * batch_size
                    writer.write_scalars(done, m)
                    history.update(train_loss=m["loss"], steps_per_second=rate)
                    history["losses"].append((done, m["loss"]))
                    speed = ("" if rate is None else
                             f", {rate:.1f} steps/s, {rate * batch_size:.0f} examples/s ({progress.note})")
                    log.info("step %d/%d: loss %.4f%s", done, total, m["loss"], speed)
                for run in stages:
                    if run.evaluate_fn is not None and done == run.end:
                        record_stage(run, done)
                if done % int(config.eval_every) == 0 or last:
                    # no dispatch barrier: evaluate ends by fetching its outputs, so its time is whole
                    with progress.timed("eval"):
                        eval_metrics = record_eval(done)
                if done % int(config.checkpoint_every) == 0 or last or stop.is_set():
                    save(ckpt, state, done, config, wall_seconds=time.perf_counter() - t_start)
                if stop.is_set():
                    ckpt.wait()
                    log.warning("SIGTERM at step %d: checkpoint saved, exiting", done)
                    break
        finally:
            batches.close()
            ckpt.close()
            writer.close()

    if not eval_metrics and not stop.is_set():   # resumed at the end already: still report the metrics
        eval_metrics = evaluate_fn(state)
    summary = Summary({"step": int(jax.device_get(state["step"])), "train_loss": history["train_loss"], **eval_metrics,
                       "steps_per_second": history["steps_per_second"], "attention": config.model.attention.kind,
                       "checkpoint_dir": str(ckpt.directory),
                       "tensorboard_dir": str((workdir / "tensorboard").absolute()), "preempted": stop.is_set(),
                       "train_loss_history": history["losses"], "eval_history": history["evals"],
                       "num_params": total_params, "trainable_params": trained,
                       "trainable_fraction": trained / max(total_params, 1),
                       "wall_seconds": time.perf_counter() - t_start})
    for run in stages:
        if stage_history[run.stage.name]:
            summary[run.stage.summary_key] = stage_history[run.stage.name]
    summary.state = state
    if jax.process_index() == 0:
        atomic.write_text(workdir / "summary.json", json.dumps(summary, indent=1))
    return summary
