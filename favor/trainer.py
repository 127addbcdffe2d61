"""The training loop: config -> mesh -> data -> model -> shardings -> step -> checkpoint -> eval -> loop.

`run(config, workdir)` is what `train.py` calls; it is the list of those sections, each one call of a
function below. The step functions (`train_step`, `gradients`, `eval_step`, `evaluate`: favor/train/steps.py)
are module-level functions of (state, batch) whose static parts are keyword arguments, bound with
functools.partial before jit (as the Flax examples do), so a test can call any of them alone.

The train state is a pytree {step, params, rest, opt_state, bad_step}: `params` the model's nnx.Param
state, `rest` everything else the model holds (random-feature draws, dropout rng counters, batch stats).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from clu import metric_writers, periodic_actions
from flax import nnx
from jax.experimental import multihost_utils

from favor import checkpoint, configlib, data, models, optim, sharding, tasks, transfer, uptrain
from favor import attention as attention_lib
from favor.attention import schedule
from favor.data import atomic
from favor.data.prefetch import prefetch
from favor.train.steps import eval_step, evaluate, init_state, train_step, with_features

log = logging.getLogger("favor.train")

FEATURES_STREAM = 0x0F0F        # ω's rng stream, apart from the params and dropout ones
EVAL_FEATURES_STREAM = 0xE7A1   # the one ω every evaluation of a run uses


class NonFiniteLoss(RuntimeError):
    """A step produced a non-finite loss, gradient or update; the message names the step."""


class Summary(dict):
    """What `run` returns and writes to summary.json; `.state` is the final train state (device
    arrays, kept out of the JSON). A dict, so callers that only read the metrics index it as before."""

    state: Any = None


# -- config -> model ---------------------------------------------------------------------------------
def model_builder(config):
    """(build: () -> the model, the model's full keyword set) from `config.model`."""
    m = config.model.to_dict()
    name, preset = m.pop("name"), m.pop("preset", "tiny")
    m.pop("init_from", None)                          # a trainer option, not a model one (warm_start)
    m["attention"] = attention_lib.block_options(config.model.attention)
    ignored = attention_lib.ignored_block_options(config.model.attention)
    if ignored:
        log.info("attention %s does not take %s; ignored", m["attention"]["kind"], ", ".join(ignored))
    kind = m["attention"]["kind"]
    if not m["attention"].get("qk_norm") and not getattr(attention_lib.get(kind), "positive", True):
        # sign-indefinite estimates at the norms queries and keys reach unnormalised: the denominators go
        # near zero or negative (floored, but a floored row carries no signal), and the model barely learns
        log.warning("attention %s without qk_norm trains poorly (the default job: trig 31 %%, HRF 24 %% "
                    "against 95 %% and 94 %% with it; README, the kernel ablation); set "
                    "--config.model.attention.qk_norm=l2", kind)
    full = models.config(name, preset, **m)          # validates every key before anything is built
    seed = int(config.seed)

    def build():
        return models.get(name, preset, rngs=nnx.Rngs(params=seed, dropout=seed + 1, features=seed + 2), **m)
    return build, full


def redraw_schedule(config) -> schedule.Redraw:
    return schedule.parse(attention_lib.block_redraw(config.model.attention))


def features_base(config):
    return jax.random.fold_in(jax.random.PRNGKey(int(config.seed)), FEATURES_STREAM)


def features_key(config, step):
    """ω for `step`: its own stream folded with the step's redraw window, so a resumed run draws
    exactly what an uninterrupted one does."""
    return redraw_schedule(config).key(features_base(config), step)


def build_source(config):
    """The data source; on several processes process 0 builds it first (first-use work: a local corpus,
    a tokenizer, packed tokens, written to a shared data_dir), the others then find it prepared."""
    if jax.process_count() == 1:
        return data.get(config.data)
    source = data.get(config.data) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("favor: data prepared")
    return source if source is not None else data.get(config.data)


# -- the run's sections ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """How the run builds its model and train state, known before any memory is used."""
    graphdef: Any
    init: Callable[[], dict]       # a fresh train state (jitted with out_shardings to create it)
    abstract: dict                 # the train state's shapes and dtypes
    logical: Any                   # the parameters' logical axis names
    tx: optax.GradientTransformation
    lr_schedule: Callable          # of the run's step (the main stage starts after the transfer stage)
    transfer_tx: optax.GradientTransformation | None = None    # the attention-transfer stage, if any
    teacher: Any = None            # (graphdef, rest) of the softmax twin, with a transfer stage


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the train state and the batches live on the mesh."""
    mesh: jax.sharding.Mesh
    state: dict                    # a NamedSharding per train-state leaf
    abstract: dict                 # the train state's ShapeDtypeStructs with those shardings
    pad_hosts: bool                # the source sizes batches per host: pad hosts to a common shape

    @property
    def replicated(self):
        return sharding.replicated(self.mesh)

    @property
    def batch(self):
        return sharding.batch_sharding(self.mesh)

    def global_batch(self, local):
        return sharding.global_batch(local, self.mesh, self.pad_hosts)


def make_data(config):
    source = build_source(config)
    task = tasks.get(config.task)
    if hasattr(task, "bind"):        # tasks that need what the data built (the CTC task decodes with its tokenizer)
        task.bind(source)
    return source, task


def make_model(config, source) -> ModelPlan:
    build, model_cfg = model_builder(config)
    needed = getattr(source, "vocab_size", None)     # a tokenizer's vocabulary must fit the embedding
    if needed and "vocab_size" in model_cfg and model_cfg["vocab_size"] < needed:
        raise ValueError(f"config.model.vocab_size {model_cfg['vocab_size']} is smaller than the tokenizer's "
                         f"{needed} pieces; set --config.model.vocab_size={needed} (or larger)")
    abstract_model = nnx.eval_shape(build)
    graphdef, abs_params, _ = nnx.split(abstract_model, nnx.Param, ...)
    transfer_end = transfer_steps(config)        # the step the main stage starts at
    tx, schedule_ = optim.make(config.optim, max(int(config.total_steps) - transfer_end, 1), params=abs_params,
                               num_layers=model_cfg["num_layers"])
    lr_schedule = schedule_ if not transfer_end else (lambda step: schedule_(jnp.maximum(step - transfer_end, 0)))
    transfer_tx = teacher = None
    if transfer_end:
        mask = uptrain.trainable_mask(abs_params, str(config.uptrain.trainable))
        if not any(jax.tree.leaves(mask)):
            raise ValueError(f"config.uptrain.trainable={config.uptrain.trainable!r} selects no parameter")
        transfer_tx = transfer.optimizer(config.uptrain, mask)
        softmax = config.copy_and_resolve_references()
        with softmax.unlocked():
            softmax.model.attention = {"kind": "softmax"}
        teacher = transfer.teacher_of(model_builder(softmax)[0])
    init = lambda: init_state(build(), tx, transfer_tx)
    return ModelPlan(graphdef, init, jax.eval_shape(init), models.logical_axes(abstract_model), tx, lr_schedule,
                 transfer_tx, teacher)


def transfer_steps(config) -> int:
    return int(config.get("uptrain", {}).get("transfer_steps", 0) or 0)


def make_layout(model: ModelPlan, mesh, rules, source) -> Layout:
    param_sh = sharding.param_shardings(model.abstract["params"], model.logical, mesh, dict(rules))
    rep = sharding.replicated(mesh)
    opt_sh = optax.tree_map_params(model.tx, lambda _, s: s, model.abstract["opt_state"], param_sh,
                                   transform_non_params=lambda _: rep)
    state_sh = {"step": rep, "params": param_sh, "rest": jax.tree.map(lambda _: rep, model.abstract["rest"]),
                "opt_state": opt_sh, "bad_step": rep}
    if model.transfer_tx is not None:
        state_sh["teacher"] = param_sh
        state_sh["transfer_opt_state"] = optax.tree_map_params(
            model.transfer_tx, lambda _, s: s, model.abstract["transfer_opt_state"], param_sh,
            transform_non_params=lambda _: rep)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model.abstract, state_sh)
    return Layout(mesh, state_sh, abstract, bool(getattr(source, "host_dependent_shapes", False)))


def make_train_step(config, model: ModelPlan, task, layout: Layout):
    step = partial(train_step, graphdef=model.graphdef, task=task, tx=model.tx, lr_schedule=model.lr_schedule,
                   redraw=redraw_schedule(config), features_base=features_base(config),
                   accumulate=int(config.optim.accumulate_steps))
    return jax.jit(step, in_shardings=(layout.state, layout.batch), out_shardings=(layout.state, layout.replicated),
                   donate_argnums=0)


def make_transfer_step(config, model: ModelPlan, task, layout: Layout):
    """The attention-transfer stage's step (None without one)."""
    if model.transfer_tx is None:
        return None
    step = partial(transfer.transfer_step, graphdef=model.graphdef, teacher=model.teacher, task=task,
                   tx=model.transfer_tx, redraw=redraw_schedule(config), features_base=features_base(config))
    return jax.jit(step, in_shardings=(layout.state, layout.batch), out_shardings=(layout.state, layout.replicated),
                   donate_argnums=0)


def restore_or_init(config, workdir: Path, model: ModelPlan, layout: Layout):
    """(checkpointer, state, start step): the newest whole checkpoint, else a fresh (or warm) state."""
    ckpt = checkpoint.Checkpointer(workdir / "checkpoints", keep=int(config.keep_checkpoints))
    restored = ckpt.restore_latest(layout.abstract)
    if restored is None:
        state = jax.jit(model.init, out_shardings=layout.state)()
        if config.model.get("init_from"):     # only here: a resumed run continues from its own checkpoints
            source = uptrain.parse(config.model.init_from)
            state["params"] = uptrain.load_params(config, source, state["params"], layout.state["params"])
            if "teacher" in state:
                state["teacher"] = jax.tree.map(jnp.copy, state["params"])
        return ckpt, state, 0
    state, meta, start = restored
    log.info("resumed from step %d (%s, %.0f s of training before)", start, ckpt.directory,
             float(meta.get("wall_seconds", 0.0)))
    if int(meta.get("data_position", start)) != start:
        raise RuntimeError(f"checkpoint {start}: data position {meta['data_position']} != step {start}")
    return ckpt, state, start


def eval_features_fn(config, model: ModelPlan):
    """(params, rest) -> rest with the ω every evaluation of the run uses; None when ω is never redrawn."""
    if not redraw_schedule(config).redraws:
        return None
    key = jax.random.fold_in(jax.random.PRNGKey(int(config.seed)), EVAL_FEATURES_STREAM)
    return jax.jit(partial(with_features, graphdef=model.graphdef, key=key))


def make_evaluate(config, model: ModelPlan, task, source, layout: Layout) -> Callable[[dict], dict]:
    """state -> the task's metrics on the whole eval split, with one fixed ω for every evaluation of a run."""
    features_fn = eval_features_fn(config, model)
    # outputs replicated: every host gets the whole batch's outputs (per-example predictions included),
    # so the host-side metrics (GLUE F1, WER) see the full split on any number of processes
    step_fn = jax.jit(partial(eval_step, graphdef=model.graphdef, task=task), out_shardings=layout.replicated)

    def run_eval(state):
        batches = (layout.global_batch(b) for b in source.eval_batches(int(config.eval_batch_size)))
        return evaluate(state, batches, step_fn=step_fn, finalize=task.finalize, features_fn=features_fn)
    return run_eval


def make_transfer_eval(config, model: ModelPlan, task, source, layout: Layout):
    """state -> per-layer attention MSE against the softmax teacher on the eval split (None without a
    transfer stage)."""
    if model.transfer_tx is None:
        return None
    features_fn = eval_features_fn(config, model)
    step_fn = jax.jit(partial(transfer.layer_errors, graphdef=model.graphdef, teacher=model.teacher, task=task),
                      out_shardings=layout.replicated)

    def run_eval(state):
        batches = (layout.global_batch(b) for b in source.eval_batches(int(config.eval_batch_size)))
        return transfer.eval_errors(state, batches, step_fn=step_fn, features_fn=features_fn)
    return run_eval


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


class Progress(periodic_actions.ReportProgress):
    """clu's progress report every `every_steps` and at the last step (steps/s, ETA and the share of
    time in eval as the work unit's note; `steps_per_sec` and `uptime` in TensorBoard), keeping the
    rate of the latest window for the loop's log line and examples/s."""

    def __init__(self, **kwargs):
        # every_secs off: the report comes at logging steps only, right after the loop's device sync,
        # so each window's rate counts finished steps, not dispatched ones
        super().__init__(every_secs=None, **kwargs)
        self.steps_per_second = None

    def _apply(self, step, t):
        self.steps_per_second = (step - self._previous_step) / max(t - self._previous_time, 1e-9)
        super()._apply(step, t)


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


def train_loop(config, workdir: Path, state, start: int, *, step_fn, evaluate_fn, ckpt, source, layout: Layout,
               t_start: float, transfer_fn=None, transfer_eval_fn=None) -> Summary:
    """The steps from `start` to total_steps: the attention-transfer stage's (`transfer_fn`) first
    when there is one, then `step_fn`'s; logs, evals, checkpoints, SIGTERM. A run that starts from
    another model's parameters evaluates them first (step 0)."""
    total, log_every, batch_size = int(config.total_steps), int(config.log_every), int(config.batch_size)
    writer = metric_writers.create_default_writer(str(workdir / "tensorboard"), just_logging=jax.process_index() > 0)
    progress = Progress(num_train_steps=total, every_steps=log_every, writer=writer)
    batches = prefetch(source.train_batches(batch_size, start, int(config.seed)), int(config.get("prefetch", 2)))
    history = {"train_loss": None, "steps_per_second": None, "losses": [], "evals": [], "attention_mse": {}}
    eval_metrics = {}
    transfer_end = transfer_steps(config)

    def record_eval(step):
        metrics = evaluate_fn(state)
        seconds = time.perf_counter() - t_start
        history["evals"].append({"step": step, "seconds": seconds, **metrics})
        # the run's own clock beside each eval (resumes included, gaps between them not): what
        # favor.report plots the metric against, where TensorBoard's wall time would count the gaps
        writer.write_scalars(step, {**{f"eval/{k}": v for k, v in metrics.items()}, "time/wall_seconds": seconds})
        log.info("step %d eval %s", step, metrics)
        return metrics

    def record_attention_mse(step):
        errors = transfer_eval_fn(state)
        history["attention_mse"][str(step)] = errors
        writer.write_scalars(step, {f"transfer/eval_mse_layer_{i}": e for i, e in enumerate(errors)})
        log.info("step %d attention MSE against softmax, per layer: %s", step, ", ".join(f"{e:.4g}" for e in errors))

    if start == 0 and config.model.get("init_from"):     # day 0: the source's parameters with this kind
        eval_metrics = record_eval(0)
    if transfer_eval_fn is not None and start == 0:
        record_attention_mse(0)
    with preemption() as stop:
        try:
            for step in range(start, total):
                fn = transfer_fn if step < transfer_end else step_fn
                state, metrics = fn(state, layout.global_batch(next(batches)))
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
                    speed = "" if rate is None else f", {rate:.1f} steps/s, {rate * batch_size:.0f} examples/s"
                    log.info("step %d/%d: loss %.4f%s", done, total, m["loss"], speed)
                if transfer_eval_fn is not None and done == transfer_end:
                    record_attention_mse(done)
                if done % int(config.eval_every) == 0 or last:
                    # no dispatch barrier: evaluate ends by fetching its outputs, so its time is whole
                    with progress.timed("eval", wait_jax_async_dispatch=False):
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
            writer.flush()

    if not eval_metrics and not stop.is_set():   # resumed at the end already: still report the metrics
        eval_metrics = evaluate_fn(state)
    summary = Summary({"step": int(jax.device_get(state["step"])), "train_loss": history["train_loss"], **eval_metrics,
                       "steps_per_second": history["steps_per_second"], "attention": config.model.attention.kind,
                       "checkpoint_dir": str(ckpt.directory),
                       "tensorboard_dir": str((workdir / "tensorboard").absolute()), "preempted": stop.is_set(),
                       "train_loss_history": history["losses"], "eval_history": history["evals"],
                       "num_params": num_params(state["params"]), "wall_seconds": time.perf_counter() - t_start})
    if history["attention_mse"]:
        summary["attention_mse"] = history["attention_mse"]
    summary.state = state
    if jax.process_index() == 0:
        atomic.write_text(workdir / "summary.json", json.dumps(summary, indent=1))
    return summary


def num_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


# -- the run ---------------------------------------------------------------------------------------------
def run(config, workdir) -> Summary:
    """Train `config` in `workdir`, resuming from its newest whole checkpoint. Returns the summary
    (also written to workdir/summary.json) with the final train state as `summary.state`."""
    t_start = time.perf_counter()
    configlib.validate(config)           # every key, before anything is built or compiled
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = sharding.make_mesh(config.mesh)
    config = with_tokenizer(config, workdir)
    if jax.process_index() == 0:         # the whole config, overrides applied: what favor.report compares
        atomic.write_text(workdir / "config.json", config.to_json(indent=1))
    source, task = make_data(config)
    uptrain.record_tokenizer(source, workdir)
    model = make_model(config, source)
    layout = make_layout(model, mesh, config.sharding_rules, source)
    step_fn = make_train_step(config, model, task, layout)
    ckpt, state, start = restore_or_init(config, workdir, model, layout)
    t_start -= float((ckpt.restored_meta or {}).get("wall_seconds", 0.0))   # a resumed run's clock goes on
    evaluate_fn = make_evaluate(config, model, task, source, layout)
    return train_loop(config, workdir, state, start, step_fn=step_fn, evaluate_fn=evaluate_fn, ckpt=ckpt,
                      source=source, layout=layout, t_start=t_start,
                      transfer_fn=make_transfer_step(config, model, task, layout),
                      transfer_eval_fn=make_transfer_eval(config, model, task, source, layout))


def with_tokenizer(config, workdir: Path):
    """`config`, with `data.tokenizer` set when it is empty and the run has a recorded tokenizer (its own,
    resumed) or starts from a model that has one (favor.uptrain.tokenizer_spec)."""
    spec = uptrain.tokenizer_spec(config, workdir)
    if not spec:
        return config
    log.info("tokenizer: %s (%s)", spec, "this run's own" if str(workdir.absolute()) in spec else "the source model's")
    config = config.copy_and_resolve_references()
    config.data.tokenizer = spec
    return config


def rebuild(config, workdir: Path):
    """(config, data source, task, model plan, layout, state) of a run rebuilt from the parameters of its
    `model.init_from`, no step taken: what evaluating or inspecting a checkpoint starts from (the config
    returned carries the tokenizer that travels with the source)."""
    config = with_tokenizer(config, Path(workdir))
    source, task = make_data(config)
    model = make_model(config, source)
    layout = make_layout(model, sharding.make_mesh(config.mesh), config.sharding_rules, source)
    state = jax.jit(model.init, out_shardings=layout.state)()
    state["params"] = uptrain.load_params(config, uptrain.parse(config.model.init_from), state["params"],
                                          layout.state["params"])
    return config, source, task, model, layout, state
