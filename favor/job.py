"""A training job: config -> mesh -> data -> model -> shardings -> steps -> state -> the loop.

`run(config, workdir)` is what `train.py` calls; it is the list of those sections, each one call of a
function below. The loop and the step functions are favor.train's; where a run's parameters and
tokenizer come from, and its attention-transfer stage, are favor.uptrain's: this module joins them.

The train state is a pytree {step, params, rest, opt_state, bad_step} and each stage's entries:
`params` the model's nnx.Param state, `rest` everything else the model holds (random-feature draws,
dropout rng counters, batch stats).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental import multihost_utils

from favor import data, models, sharding, tasks, uptrain
from favor.train import checkpoint, rundir
from favor.data import source as source_lib
from favor.config.checks import ConfigError, integer
from favor import attention as attention_lib
from favor.attention import schedule
from favor.train import optim, stage as stage_lib
from favor.train.loop import StageRun, Summary, train_loop
from favor.train.steps import (eval_step, evaluate, evaluate_stage, init_state, loss_fn, stage_step, train_step,
                               with_features)

log = logging.getLogger("favor.train")

FEATURES_STREAM = 0x0F0F        # ω's rng stream, apart from the params and dropout ones
LORA_STREAM = 0x10AA            # LoRA adapters' A matrices: the base model's init draws stay the seed's
EVAL_FEATURES_STREAM = 0xE7A1   # the one ω every evaluation of a run uses


# -- config -> model ---------------------------------------------------------------------------------
def model_builder(config):
    """(build: () -> the model, the model's full keyword set) from `config.model`."""
    m = config.model.to_dict()
    name, preset = m.pop("name"), m.pop("preset", "tiny")
    m.pop("init_from", None)                          # a trainer option, not a model one (warm_start)
    kind, options, qk = attention_lib.read_block(config.model.attention, from_config=True)
    m["attention"] = {"kind": kind, **options, **qk}
    ignored = attention_lib.ignored_block_options(config.model.attention)
    if ignored:
        log.info("attention %s does not take %s; ignored", kind, ", ".join(ignored))
    if not qk["qk_norm"] and not getattr(attention_lib.get(kind), "positive", True):
        # sign-indefinite estimates at the norms queries and keys reach unnormalised: the denominators go
        # near zero or negative (floored, but a floored row carries no signal), and the model barely learns
        log.warning("attention %s without qk_norm trains poorly (the default job: trig 31 %%, HRF 24 %% "
                    "against 95 %% and 94 %% with it; README, the kernel ablation); set "
                    "--config.model.attention.qk_norm=l2", kind)
    full = models.config(name, preset, **m)          # validates every key before anything is built
    seed = int(config.seed)
    up = config.get("uptrain", {})
    lora_on = uptrain.uses_lora(up)

    def build(keys=None):
        """keys: {"params", "dropout", "features"} -> typed PRNG keys, default those of config.seed. Passed
        in (rather than made here) when building under jit, so the seed is an argument of the program
        and not a constant in it. A LoRA run's model carries its adapters (favor.models.lora)."""
        keys = model_keys(seed) if keys is None else keys
        model = models.get(name, preset, rngs=nnx.Rngs(**keys), **m)
        if lora_on:
            try:
                models.lora.add(model, int(up.lora_rank), float(up.lora_alpha), str(up.lora_targets),
                                rngs=nnx.Rngs(params=jax.random.fold_in(keys["params"], LORA_STREAM)))
            except ValueError as e:          # targets that select nothing: the config's error
                raise ConfigError("uptrain.lora_targets", str(up.lora_targets), str(e)) from None
        return model
    return build, full


def trainable(config, abstract_params):
    """What the main training trains: a bool per parameter for a LoRA run (its adapters and
    uptrain.lora_also), None (everything) otherwise."""
    up = config.get("uptrain", {})
    if not uptrain.uses_lora(up):
        return None
    return uptrain.trainable_mask(abstract_params, "lora", str(up.get("lora_also", "")))


def model_keys(seed: int) -> dict:
    """The model's rng streams for `seed` (the keys nnx.Rngs(params=seed, dropout=seed + 1,
    features=seed + 2) would make)."""
    return {"params": jax.random.key(seed), "dropout": jax.random.key(seed + 1),
            "features": jax.random.key(seed + 2)}


def redraw_schedule(config) -> schedule.Redraw:
    return schedule.parse(attention_lib.block_redraw(config.model.attention))


def features_base(config):
    return jax.random.fold_in(jax.random.PRNGKey(int(config.seed)), FEATURES_STREAM)


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
    init: Callable[[dict], dict]   # model_keys -> a fresh train state (`initial_state` jits it)
    abstract: dict                 # the train state's shapes and dtypes
    logical: Any                   # the parameters' logical axis names
    tx: optax.GradientTransformation
    lr_schedule: Callable          # of the run's step (the main training starts after the stages)
    stages: tuple = ()             # favor.train.stage.Stage, run in order before the main training
    trainable: Any = None          # a bool per parameter: what the main training trains (None: all)


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
    stages = make_stages(config, abs_params)
    main_start = stage_lib.main_start(stages)
    tx, schedule_ = optim.make(config.optim, max(int(config.total_steps) - main_start, 1), params=abs_params,
                               num_layers=model_cfg["num_layers"])
    mask = trainable(config, abs_params)
    if mask is not None:                 # frozen parameters: no update and no optimizer state
        tx = uptrain.transfer.masked(tx, mask)
    lr_schedule = schedule_ if not main_start else (lambda step: schedule_(jnp.maximum(step - main_start, 0)))
    init = lambda keys: init_state(build(keys), tx, stages)
    abstract = jax.eval_shape(init, model_keys(int(config.seed)))
    return ModelPlan(graphdef, init, abstract, models.logical_axes(abstract_model), tx, lr_schedule, stages, mask)


def initial_state(config, model: ModelPlan, layout: Layout) -> dict:
    """A fresh train state on the mesh. The seed's keys are arguments of the jitted program, so runs that
    differ only in their seed (a sweep's) share its compiled form through the persistent cache."""
    return jax.jit(model.init, out_shardings=layout.state)(model_keys(int(config.seed)))


def make_stages(config, abstract_params) -> tuple:
    """The run's stages before the main training: attention transfer when config.uptrain asks for it."""
    def build_softmax():
        softmax = config.copy_and_resolve_references()
        with softmax.unlocked():
            softmax.model.attention = {"kind": "softmax"}
        return model_builder(softmax)[0]()
    transfer = uptrain.transfer.stage(config.get("uptrain", {}), abstract_params, build_softmax)
    return tuple(s for s in (transfer,) if s is not None)


def make_layout(model: ModelPlan, mesh, rules, source) -> Layout:
    param_sh = sharding.param_shardings(model.abstract["params"], model.logical, mesh, dict(rules))
    rep = sharding.replicated(mesh)
    opt_sh = sharding.like_params(model.abstract["opt_state"], model.abstract["params"], param_sh, rep)
    state_sh = {"step": rep, "params": param_sh, "rest": jax.tree.map(lambda _: rep, model.abstract["rest"]),
                "opt_state": opt_sh, "bad_step": rep}
    for stage in model.stages:
        state_sh.update({k: param_sh for k in stage.entry_keys})
        state_sh[stage.opt_key] = sharding.like_params(model.abstract[stage.opt_key], model.abstract["params"],
                                                       param_sh, rep)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model.abstract, state_sh)
    return Layout(mesh, state_sh, abstract, bool(getattr(source, "host_dependent_shapes", False)))


@dataclasses.dataclass(frozen=True)
class KeyedStep:
    """(state, batch) -> (state, metrics): a jitted step given ω's stream key as an argument. A key built
    into the program as a constant would make every seed a program of its own, compiled anew by each
    run of a sweep; as an argument, runs that differ in their seed share one compiled program."""
    jitted: Callable
    features_base: jax.Array

    def __call__(self, state, batch):
        return self.jitted(state, batch, self.features_base)

    def lower(self, state, batch):
        return self.jitted.lower(state, batch, self.features_base)


def _with_features_base(step, config, layout: Layout) -> KeyedStep:
    jitted = jax.jit(lambda state, batch, base: step(state, batch, features_base=base),
                     in_shardings=(layout.state, layout.batch, layout.replicated),
                     out_shardings=(layout.state, layout.replicated), donate_argnums=0)
    return KeyedStep(jitted, features_base(config))


def make_train_step(config, model: ModelPlan, task, layout: Layout):
    step = partial(train_step, graphdef=model.graphdef, task=task, tx=model.tx, lr_schedule=model.lr_schedule,
                   redraw=redraw_schedule(config), accumulate=int(config.optim.accumulate_steps),
                   trainable=model.trainable)
    return _with_features_base(step, config, layout)


def make_stage_runs(config, model: ModelPlan, task, source, layout: Layout) -> tuple[StageRun, ...]:
    """Each stage's jitted step and evaluation (on the eval split, with the evaluation ω), in order."""
    runs = []
    for stage, first, end in stage_lib.spans(model.stages):
        step = partial(stage_step, stage=stage, graphdef=model.graphdef, task=task, redraw=redraw_schedule(config))
        step_fn = _with_features_base(step, config, layout)
        runs.append(StageRun(stage, first, end, step_fn, _stage_evaluate(config, model, task, source, layout, stage)))
    return tuple(runs)


def _stage_evaluate(config, model: ModelPlan, task, source, layout: Layout, stage):
    """state -> the stage's evaluation on the eval split (None when it has none)."""
    if stage.evaluate is None:
        return None
    features_fn = eval_features_fn(config, model)
    step_fn = jax.jit(partial(stage.evaluate, graphdef=model.graphdef, task=task), out_shardings=layout.replicated)

    def run_eval(state):
        batches = (layout.global_batch(b) for b in source.eval_batches(int(config.eval_batch_size)))
        return evaluate_stage(state, batches, stage=stage, step_fn=step_fn, features_fn=features_fn)
    return run_eval


def restore_or_init(config, workdir: Path, model: ModelPlan, layout: Layout):
    """(checkpointer, state, start step): the newest whole checkpoint, else a fresh (or warm) state."""
    ckpt = checkpoint.Checkpointer(workdir / "checkpoints", keep=int(config.keep_checkpoints))
    restored = ckpt.restore_latest(layout.abstract)
    if restored is None:
        state = initial_state(config, model, layout)
        if config.model.get("init_from"):     # only here: a resumed run continues from its own checkpoints
            state = warm_start(config, model, layout, state)
        return ckpt, state, 0
    state, meta, start = restored
    log.info("resumed from step %d (%s, %.0f s of training before)", start, ckpt.directory,
             float(meta.get("wall_seconds", 0.0)))
    if int(meta.get("data_position", start)) != start:
        raise RuntimeError(f"checkpoint {start}: data position {meta['data_position']} != step {start}")
    return ckpt, state, start


def warm_start(config, model: ModelPlan, layout: Layout, state):
    """`state` with the parameters of `model.init_from` put in place, and every stage's entries made from
    them (copies: a step donates the state, and one buffer must not be donated twice)."""
    state = dict(state)
    state["params"] = uptrain.load_params(config, uptrain.parse(config.model.init_from), state["params"],
                                          layout.state["params"])
    for stage in model.stages:
        state.update(jax.tree.map(jnp.copy, stage.entries(state["params"])))
    return state


def eval_features_fn(config, model: ModelPlan):
    """(params, rest) -> rest with the ω every evaluation of the run uses; None when ω is never redrawn."""
    if not redraw_schedule(config).redraws:
        return None
    key = jax.random.fold_in(jax.random.PRNGKey(int(config.seed)), EVAL_FEATURES_STREAM)
    jitted = jax.jit(partial(with_features, graphdef=model.graphdef))      # the key an argument, as in the steps
    return lambda params, rest: jitted(params, rest, key=key)


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


# -- the run ---------------------------------------------------------------------------------------------
RUN_KEYS = ("seed", "total_steps", "batch_size", "eval_batch_size", "checkpoint_every", "eval_every", "log_every",
            "keep_checkpoints", "mesh", "data", "task", "model", "optim")


def validate(config) -> None:
    """Check every key a run reads, before anything is built or compiled: the run's own keys here, then each
    block by the package that owns it (the optimizer, the mesh and batches, the model, uptraining, data,
    task). The first bad key is a ConfigError `config.<key>=<value>: <what is allowed>`; registered names
    (attention kind, dataset, task, model) name the valid choices."""
    missing = [k for k in RUN_KEYS if k not in config]
    if missing:
        raise ConfigError(missing[0], None, "is required (every configs/*.py sets it through blocks.run_config)")
    integer(config, "seed", 0)
    integer(config, "total_steps", 0)
    for key in ("checkpoint_every", "eval_every", "log_every", "keep_checkpoints"):
        integer(config, key, 1)
    if "prefetch" in config:
        integer(config, "prefetch", 0)
    sharding.check(config, accumulate=optim.check(config))
    models.check(config)
    uptrain.check(config)
    for key, package in (("data", data), ("task", tasks)):
        name = dict(config[key]).get("name")
        if name not in package.names():
            raise ConfigError(f"{key}.name", name, f"must be one of {', '.join(package.names())}")
        try:
            package.check(config[key])          # option names (values: the source or task checks them)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(key, dict(config[key]), str(e)) from None


def run(config, workdir) -> Summary:
    """Train `config` in `workdir`, resuming from its newest whole checkpoint. Returns the summary
    (also written to workdir/summary.json) with the final train state as `summary.state`."""
    t_start = time.perf_counter()
    validate(config)                     # every key, before anything is built or compiled
    workdir = Path(workdir)
    rundir.check(config, workdir)        # a new directory, or this config's own run (resumed)
    # Nothing is written to the workdir until every check below has passed (the data, the model, the
    # checkpoint's fit, the source of init_from): a start that fails leaves it as it was.
    mesh = sharding.make_mesh(config.mesh)
    with source_lib.process_rows(partial(sharding.process_rows, mesh)), sharding.sequence_context(mesh):
        return _run(config, workdir, mesh, t_start)


def _run(config, workdir, mesh, t_start):
    config = with_tokenizer(config, workdir)
    source, task = make_data(config)
    model = make_model(config, source)
    layout = make_layout(model, mesh, config.sharding_rules, source)
    step_fn = make_train_step(config, model, task, layout)
    ckpt, state, start = restore_or_init(config, workdir, model, layout)
    if ckpt.restored_meta is None and config.model.get("init_from"):
        state = calibrate_statistics(config, model, task, source, layout, state)
    t_start -= float((ckpt.restored_meta or {}).get("wall_seconds", 0.0))   # a resumed run's clock goes on
    evaluate_fn = make_evaluate(config, model, task, source, layout)
    stages = make_stage_runs(config, model, task, source, layout)
    rundir.record(config, workdir)
    uptrain.record_tokenizer(source, workdir)
    return train_loop(config, workdir, state, start, step_fn=step_fn, evaluate_fn=evaluate_fn, ckpt=ckpt,
                      source=source, layout=layout, t_start=t_start, stages=stages,
                      eval_first=bool(config.model.get("init_from")), trainable=model.trainable)


def _is_fit_statistics(path) -> bool:
    return "fit_stats" in jax.tree_util.keystr(path)


def calibrate_statistics(config, model: ModelPlan, task, source, layout: Layout, state):
    """`state` with the running fit statistics of its causal data-dependent layers (FAVOR++, FAVOR#,
    HRF-cluster) taken from the first training batch. For a run that starts from another model's
    parameters: a softmax source keeps no statistics, and without them these kinds evaluate at day 0,
    and take their first step, as their data-independent member. A training-mode pass on the batch gives
    them (as BatchNorm's statistics are re-estimated); nothing else of the state changes."""
    if not any(_is_fit_statistics(p) for p, _ in jax.tree_util.tree_flatten_with_path(state["rest"])[0]):
        return state
    batch = layout.global_batch(next(iter(source.train_batches(int(config.batch_size), 0, int(config.seed)))))

    def fitted(params, rest, batch):
        _, (_, new) = loss_fn(params, rest, batch, graphdef=model.graphdef, task=task)
        return jax.tree_util.tree_map_with_path(lambda p, old, fit: fit if _is_fit_statistics(p) else old, rest, new)
    rest = jax.jit(fitted, out_shardings=layout.state["rest"])(state["params"], state["rest"], batch)
    log.info("fit statistics of the causal data-dependent layers: calibrated on the first training batch")
    return dict(state, rest=rest)


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
    returned carries the tokenizer that travels with the source; the stages' entries are made from the
    loaded parameters, as a fresh run's are)."""
    config = with_tokenizer(config, Path(workdir))
    source, task = make_data(config)
    model = make_model(config, source)
    mesh = sharding.make_mesh(config.mesh)
    layout = make_layout(model, mesh, config.sharding_rules, source)
    with sharding.sequence_context(mesh):
        state = warm_start(config, model, layout, initial_state(config, model, layout))
        state = calibrate_statistics(config, model, task, source, layout, state)
    return config, source, task, model, layout, state
