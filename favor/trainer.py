"""The training loop: config -> mesh -> data -> model -> shardings -> step -> checkpoint -> eval -> loop.

`run(config, workdir)` is what `train.py` calls. It reads top to bottom in those sections. The train
state is a pytree {step, params, rest, opt_state, bad_step}: `params` the model's nnx.Param state,
`rest` everything else the model holds (random-feature draws, dropout rng counters, batch stats).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from favor import attention as attention_lib
from favor import checkpoint, data, models, optim, sharding, tasks

log = logging.getLogger("favor.train")


class NonFiniteLoss(RuntimeError):
    """A step produced a non-finite loss, gradient or update; the message names the step."""


# -- config -> model ---------------------------------------------------------------------------------
def attention_options(cfg) -> dict:
    """The config's attention block, keeping only the options the chosen kind takes (the block
    carries the random-feature options so that `--config.model.attention.kind=softmax` is a plain
    override; they are meaningless for softmax and dropped with a log line)."""
    block = dict(cfg)
    kind = block.get("kind")
    if kind not in attention_lib.names():
        raise ValueError(f"unknown attention kind {kind!r} (config.model.attention.kind); "
                         f"valid: {', '.join(attention_lib.names())}")
    accepted = attention_lib.get(kind).OPTIONS
    dropped = sorted(k for k in block if k != "kind" and k not in accepted)
    if dropped:
        log.info("attention %s does not take %s; ignored", kind, ", ".join(dropped))
    return {"kind": kind, **{k: v for k, v in block.items() if k in accepted}}


def model_builder(config):
    m = config.model.to_dict()
    name, preset = m.pop("name"), m.pop("preset", "tiny")
    m.pop("init_from", None)                          # a trainer option, not a model one (warm_start)
    m["attention"] = attention_options(config.model.attention)
    full = models.config(name, preset, **m)          # validates every key before anything is built
    seed = int(config.seed)

    def build():
        return models.get(name, preset, rngs=nnx.Rngs(params=seed, dropout=seed + 1, features=seed + 2), **m)
    return build, full


def warm_start(config, abstract_params, shardings):
    """Parameters from a Hugging Face checkpoint (`model.init_from = "hf:<dir>"`): uptraining a softmax
    BERT/ViT as a FAVOR model. The checkpoint's architecture must match the config's model."""
    spec = str(config.model.init_from)
    kind, _, path = spec.partition(":")
    if kind != "hf" or not path:
        raise ValueError(f"model.init_from {spec!r}: expected 'hf:<Hugging Face model directory>'")
    shared = ("head", "num_labels", "num_classes", "dropout", "attention_dropout", "dtype")
    keep = {k: v for k, v in config.model.to_dict().items() if k in shared}
    loaded = models.hf.load(path, attention=attention_options(config.model.attention), **keep)
    params = nnx.state(loaded, nnx.Param)
    want = jax.tree.map(lambda a: (a.shape, str(a.dtype)), abstract_params)
    got = jax.tree.map(lambda a: (a.shape, str(a.dtype)), params)
    if jax.tree.structure(want) != jax.tree.structure(got) or jax.tree.leaves(want) != jax.tree.leaves(got):
        raise ValueError(f"model.init_from {path}: the checkpoint's model differs from config.model "
                         f"(set the config's sizes to the checkpoint's config.json)")
    log.info("warm start from %s", path)
    return jax.device_put(params, shardings)


def features_key(config, step):
    """ω for `step`: its own stream (not the params or dropout ones), folded with the step (or the
    redraw window), so a resumed run draws exactly what an uninterrupted one does."""
    redraw = str(config.model.attention.get("redraw", "step"))
    base = jax.random.fold_in(jax.random.PRNGKey(int(config.seed)), 0x0F0F)
    if redraw.startswith("every:"):
        step = step // int(redraw.split(":", 1)[1])
    return jax.random.fold_in(base, step)


def redraws(config) -> bool:
    return str(config.model.attention.get("redraw", "step")) != "fixed"


def build_source(config):
    """The data source; on several processes process 0 builds it first (first-use work: a local corpus,
    a tokenizer, packed tokens, written to a shared data_dir), the others then find it prepared."""
    if jax.process_count() == 1:
        return data.get(config.data)
    from jax.experimental import multihost_utils
    source = data.get(config.data) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("favor: data prepared")
    return source if source is not None else data.get(config.data)


# -- the loop ------------------------------------------------------------------------------------------
def run(config, workdir) -> dict:
    t_start = time.perf_counter()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    total_steps = int(config.total_steps)
    accumulate = int(config.optim.get("accumulate_steps", 1))

    # mesh
    mesh = sharding.make_mesh(config.mesh)
    sharding.check_batch(int(config.batch_size), mesh, accumulate)
    sharding.check_batch(int(config.eval_batch_size), mesh, what="eval_batch_size")
    rules = dict(config.sharding_rules)

    # data
    source = build_source(config)
    task = tasks.get(config.task)
    if hasattr(task, "bind"):        # tasks that need what the data built (the CTC task decodes with its tokenizer)
        task.bind(source)

    # model (abstract first: shapes and shardings before any memory is used)
    build, model_cfg = model_builder(config)
    needed = getattr(source, "vocab_size", None)     # a tokenizer's vocabulary must fit the embedding
    if needed and "vocab_size" in model_cfg and model_cfg["vocab_size"] < needed:
        raise ValueError(f"config.model.vocab_size {model_cfg['vocab_size']} is smaller than the tokenizer's "
                         f"{needed} pieces; set --config.model.vocab_size={needed} (or larger)")
    abstract_model = nnx.eval_shape(build)
    graphdef, abs_params, _ = nnx.split(abstract_model, nnx.Param, ...)
    tx, lr_schedule = optim.make(config.optim, total_steps, params=abs_params, num_layers=model_cfg["num_layers"])

    def init():
        _, params, rest = nnx.split(build(), nnx.Param, ...)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "rest": rest,
                "opt_state": tx.init(params), "bad_step": jnp.full((), -1, jnp.int32)}

    abstract = jax.eval_shape(init)
    logical = models.logical_axes(abstract_model)
    param_sh = sharding.param_shardings(abstract["params"], logical, mesh, rules)
    rep = sharding.replicated(mesh)
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract["opt_state"], param_sh,
                                   transform_non_params=lambda _: rep)
    state_sh = {"step": rep, "params": param_sh, "rest": jax.tree.map(lambda _: rep, abstract["rest"]),
                "opt_state": opt_sh, "bad_step": rep}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh)

    # step
    def loss_fn(params, rest, batch):
        # copy=True: fresh Variables in this (grad) trace, so dropout may advance its rng counter
        model = nnx.merge(graphdef, params, rest, copy=True)
        loss, metrics = task.loss(model, batch, deterministic=False)
        _, _, new_rest = nnx.split(model, nnx.Param, ...)
        return loss, (metrics, new_rest)

    def train_step(state, batch):
        step = state["step"]
        rest = state["rest"]
        if redraws(config):
            key = features_key(config, step)
            model = nnx.merge(graphdef, state["params"], rest, copy=True)
            models.redraw_features(model, key)
            _, _, rest = nnx.split(model, nnx.Param, ...)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if accumulate == 1:
            (loss, (metrics, rest)), grads = grad_fn(state["params"], rest, batch)
        else:   # microbatches in a scan: memory of one, the update of all
            micro = jax.tree.map(lambda x: x.reshape(accumulate, x.shape[0] // accumulate, *x.shape[1:]), batch)

            def body(carry, mb):
                g_sum, l_sum, m_sum, r = carry
                (l, (m, r)), g = grad_fn(state["params"], r, mb)
                return (jax.tree.map(jnp.add, g_sum, g), l_sum + l, jax.tree.map(jnp.add, m_sum, m), r), None

            zeros_g = jax.tree.map(jnp.zeros_like, state["params"])
            shapes = jax.eval_shape(grad_fn, state["params"], rest, jax.tree.map(lambda x: x[0], micro))
            zeros_m = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0][1][0])
            (grads, loss, metrics, rest), _ = jax.lax.scan(body, (zeros_g, 0.0, zeros_m, rest), micro)
            grads = jax.tree.map(lambda g: g / accumulate, grads)
            loss, metrics = loss / accumulate, jax.tree.map(lambda m: m / accumulate, metrics)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        all_finite = lambda t: jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(t)]))
        finite = jnp.isfinite(loss) & all_finite(grads) & all_finite(params)   # params: a bad lr shows there
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = {"step": step + 1, "params": keep(params, state["params"]), "rest": keep(rest, state["rest"]),
                     "opt_state": keep(opt_state, state["opt_state"]),
                     "bad_step": jnp.where(~finite & (state["bad_step"] < 0), step, state["bad_step"])}
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), learning_rate=lr_schedule(step))
        return new_state, metrics

    batch_sh = sharding.batch_sharding(mesh)
    pad_hosts = bool(getattr(source, "host_dependent_shapes", False))
    train_step = jax.jit(train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep),
                         donate_argnums=0)

    eval_key = jax.random.fold_in(jax.random.PRNGKey(int(config.seed)), 0xE7A1)

    @jax.jit
    def eval_rest(params, rest):
        """The model state evaluation uses: one fixed ω for every evaluation of a run."""
        model = nnx.merge(graphdef, params, rest, copy=True)
        models.redraw_features(model, eval_key)
        return nnx.split(model, nnx.Param, ...)[2]

    # outputs replicated: every host gets the whole batch's outputs (per-example predictions included),
    # so the host-side metrics (GLUE F1, WER) see the full split on any number of processes
    @partial(jax.jit, out_shardings=rep)
    def eval_step(params, rest, batch):
        return task.eval_outputs(nnx.merge(graphdef, params, rest, copy=True), batch)

    def evaluate(state):
        rest = eval_rest(state["params"], state["rest"]) if redraws(config) else state["rest"]
        outputs = [jax.device_get(eval_step(state["params"], rest, sharding.global_batch(local, mesh, pad_hosts)))
                   for local in source.eval_batches(int(config.eval_batch_size))]
        return task.finalize(outputs)

    # checkpoint: restore the newest whole one, else initialise
    ckpt = checkpoint.Checkpointer(workdir / "checkpoints", keep=int(config.keep_checkpoints))
    restored = ckpt.restore_latest(abstract)
    if restored is None:
        state = jax.jit(init, out_shardings=state_sh)()
        start = 0
        if config.model.get("init_from"):
            state["params"] = warm_start(config, abstract["params"], param_sh)
    else:
        state, meta, start = restored
        log.info("resumed from step %d (%s)", start, ckpt.directory)
        if int(meta.get("data_position", start)) != start:
            raise RuntimeError(f"checkpoint {start}: data position {meta['data_position']} != step {start}")

    def check_finite():
        bad = int(jax.device_get(state["bad_step"]))
        if bad >= 0:
            raise NonFiniteLoss(f"non-finite loss or gradient at step {bad}; stopped. The update of that step was "
                                f"not applied and no non-finite state was saved (last checkpoint: "
                                f"{ckpt.steps()[-1] if ckpt.steps() else 'none'})")

    def save(step):
        check_finite()
        ckpt.save(step, state, {"step": step, "data_position": step, "config": config.to_json()})

    # metrics
    from clu import metric_writers
    writer = metric_writers.create_default_writer(str(workdir / "tensorboard"), just_logging=jax.process_index() > 0)
    stop = {"signal": None}

    def on_sigterm(signum, frame):
        stop["signal"] = signum
    previous = signal.signal(signal.SIGTERM, on_sigterm) if _main_thread() else None

    # loop
    log_every = int(config.get("log_every", 50))
    batches = prefetch(source.train_batches(int(config.batch_size), start, int(config.seed)),
                       int(config.get("prefetch", 2)))
    history = {"train_loss": None, "losses": [], "evals": []}
    eval_metrics = {}
    t0, s0 = time.perf_counter(), start
    bar = _progress(total_steps, start)
    try:
        for step in range(start, total_steps):
            state, metrics = train_step(state, sharding.global_batch(next(batches), mesh, pad_hosts))
            done = step + 1
            last = done == total_steps
            if done % log_every == 0 or last or stop["signal"]:
                check_finite()
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                rate = (done - s0) / max(time.perf_counter() - t0, 1e-9)
                m.update(steps_per_second=rate, examples_per_second=rate * int(config.batch_size))
                writer.write_scalars(done, m)
                history.update(train_loss=m["loss"], steps_per_second=rate)
                history["losses"].append((done, m["loss"]))
                bar(done, m)
            if done % int(config.eval_every) == 0 or last:
                eval_metrics = evaluate(state)
                history["evals"].append({"step": done, "seconds": time.perf_counter() - t_start, **eval_metrics})
                writer.write_scalars(done, {f"eval/{k}": v for k, v in eval_metrics.items()})
                log.info("step %d eval %s", done, eval_metrics)
            if done % int(config.checkpoint_every) == 0 or last or stop["signal"]:
                save(done)
            if stop["signal"]:
                ckpt.wait()
                log.warning("SIGTERM at step %d: checkpoint saved, exiting", done)
                break
    finally:
        batches.close()
        ckpt.close()
        writer.flush()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        bar(None, None)

    if not eval_metrics and not stop["signal"]:   # resumed at the end already: still report the metrics
        eval_metrics = evaluate(state)
    final_step = int(jax.device_get(state["step"]))
    summary = {"step": final_step, "train_loss": history["train_loss"], **eval_metrics,
               "steps_per_second": history.get("steps_per_second"), "attention": config.model.attention.kind,
               "checkpoint_dir": str(ckpt.directory), "tensorboard_dir": str((workdir / "tensorboard").absolute()),
               "preempted": stop["signal"] is not None, "train_loss_history": history["losses"],
               "eval_history": history["evals"]}
    if jax.process_index() == 0:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    run.last_state = state       # for tests and notebooks: the final train state
    return summary


class prefetch:
    """Host batches read `depth` ahead on a background thread, so decoding and augmentation (log-mel,
    image crops, MLM masking) overlap the device step. The order is the iterator's: resumption and
    determinism are unchanged. An exception in the reader is raised in the loop; `close()` stops the
    thread (the loop calls it however it ends), so no reader outlives its run."""

    def __init__(self, iterator, depth: int):
        import queue
        import threading
        self.iterator, self.depth = iterator, int(depth)
        self.queue: queue.Queue = queue.Queue(maxsize=max(self.depth, 1))
        self.stop = threading.Event()
        self.thread = None
        if self.depth > 0:
            self.thread = threading.Thread(target=self._read, name="favor-prefetch", daemon=True)
            self.thread.start()

    def _put(self, item) -> bool:
        import queue
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _read(self):
        try:
            for item in self.iterator:
                if not self._put(item):
                    return
        except BaseException as e:         # handed to the loop, which raises it
            self._put(e)

    def __iter__(self):
        return self

    def __next__(self):
        if self.thread is None:
            return next(self.iterator)
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)


def _main_thread():
    import threading
    return threading.current_thread() is threading.main_thread()


def _progress(total, start):
    """A one-line progress bar on stderr: step, loss, steps/s, examples/s."""
    width = 30

    def show(done, m):
        if done is None:
            sys.stderr.write("\n")
            return
        filled = int(width * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} loss {m['loss']:.4f} "
                         f"{m['steps_per_second']:.1f} steps/s {m['examples_per_second']:.0f} ex/s")
        sys.stderr.flush()
    return show


