"""How good is my approximation? `python -m favor.tools.inspect --workdir <run> [--kinds favor+,favor#]
[--num_features 16,64,256] [--batches 4] [--plot out.png] [--json out.json]`.

Loads a run's newest checkpoint, feeds evaluation batches through its model (its own attention kind,
the evaluation ω), records every attention layer's input, and from it each layer's queries, keys and
values. Then, per layer and head, on those same q, k, v:
- the relative error of each kind's attention output against exact softmax,
  ‖Y_kind − Y_softmax‖ / ‖Y_softmax‖ over the valid tokens of all batches;
- the norms of the scaled queries and keys x = q·D^(−1/4), y = k·D^(−1/4) (the kernel is exp(xᵀy): the
  random-feature variances grow like e^(‖x‖² + ‖y‖²));
- the mean relative variance Var[Ŝ(x, y)] / exp(xᵀy)² over valid pairs, from the kind's analytic formula
  for M iid features (a kind or coupling without a formula, or a window kind, shows —);
- for the sign-indefinite kinds (trig, HRF), the fraction of valid query rows whose estimated denominator
  is ≤ 0 (the HRF paper's "negative fraction", its Fig. 3: rows the old guard sign-flipped) and the
  fraction below the floor n·exp(xᵀȳ) that the layer raises them to (favor.attention.floor.floored_ratio).

A kind is `kind[:variant][@window]`: `favor#:saderf`, `hrf:gaussian`, `favor+@16` (favor+ with a local
window of 16). Options not given come from the run's attention block (coupling, ...); every random-
feature kind draws its own ω per layer from `--seed`, except the run's own kind on a run that keeps one
draw (redraw "fixed"): its figures use the ω the run's layers store, the one it trained and evaluates with.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from favor import attention as attention_lib
from favor import job, strings, uptrain
from favor.attention import qknorm
from favor.models.layers import SelfAttention

DEFAULT_KINDS = ("softmax", "favor", "favor+", "favor++", "favor#")


def attention_of(block):
    """The attention a config's attention block builds, without the layer's qk_norm: that is already in
    the q and k this compares kinds on (SelfAttention.project)."""
    options, _ = qknorm.split(attention_lib.block_options(dict(block)))
    return attention_lib.get(**options)


def _build(spec, num_features, run_block):
    """The attention of `spec` with M features, the run's other options, and its row label (with its width
    for every kind that has one, random or learned)."""
    kind, opts = attention_lib.parse_spec(spec)
    block = {**dict(run_block), "kind": kind, **opts}
    if num_features is not None:
        block["num_features"] = int(num_features)
    attn = attention_of(block)
    width = getattr(attn, "num_features", None) if "num_features" in attn.OPTIONS else None
    return (spec if width is None else f"{spec} (F={width})"), attn


def run_config(workdir):
    """The config of a run's newest checkpoint, set to start from that checkpoint (`init_from=run:`), with
    no transfer stage: what rebuilding the run's model for a look at it needs."""
    spec = f"run:{Path(workdir).absolute()}"
    config = uptrain.open_checkpoint(uptrain.parse(spec)).config
    with config.unlocked():
        config.model.init_from = spec
        if "uptrain" in config:
            config.uptrain.transfer_steps = 0
    return config


def load(workdir, config=None):
    """(config, model module with the run's parameters, its evaluation batches, task) of a run's newest
    checkpoint — or of `config`'s `init_from` (a Hugging Face directory), built in `workdir`; the
    module's attention layers record their inputs."""
    workdir = Path(workdir).absolute()
    config = run_config(workdir) if config is None else config
    config, source, task, model, layout, state = job.rebuild(config, workdir)
    params, rest = state["params"], state["rest"]
    features_fn = job.eval_features_fn(config, model)
    if features_fn is not None:
        rest = features_fn(params, rest)
    module = nnx.merge(model.graphdef, params, rest)
    for _, m in nnx.iter_graph(module):
        if isinstance(m, SelfAttention):
            m.record = True
    batches = (layout.global_batch(b) for b in source.eval_batches(int(config.eval_batch_size)))
    return config, module, batches, task


def _layers(module):
    return [(tuple(path), m) for path, m in nnx.iter_graph(module) if isinstance(m, SelfAttention)]


def _relative_variance(attn, q, k, mask, ctx):
    """Mean over valid pairs (and the batch) of Var/exp(xᵀy)², per head [H]; None without a formula."""
    if not isinstance(attn, attention_lib.RandomFeatureAttention) or attn.window:
        return None
    x, y = attn.scaled(q, k)
    try:
        var = attn.mech.variance(x, y, ctx.params, attn.num_draws, "iid")
    except (TypeError, ValueError, NotImplementedError):
        return None
    log_rel = jnp.log(jnp.maximum(var.astype(jnp.float32), 0.0)) - 2.0 * jnp.einsum("bhid,bhjd->bhij", x, y)
    rel = jnp.exp(log_rel.astype(jnp.float32))
    w = jnp.ones(rel.shape, jnp.float32) if mask is None else (
        (mask[:, None, :, None] & mask[:, None, None, :]).astype(jnp.float32))
    return jnp.sum(rel * w, (0, 2, 3)) / jnp.maximum(jnp.sum(w, (0, 2, 3)), 1.0)


@partial(jax.jit, static_argnums=(0, 1))
def _kind_figures(attn, causal, q, k, v, mask, key, own_draw=None, segment_ids=None):
    """(squared error against exact softmax per token and head [B, L, H], relative variance per head or
    None, (denominator ≤ 0, below the floor) per token and head [B, L, H] or None). Softmax is computed
    in the same program, so the softmax kind's own error is exactly 0. `own_draw`: the layer's stored ω,
    used for the run's own kind when the run keeps one draw (its model never saw another). `segment_ids`:
    packed documents, which the outputs (both sides) keep apart; the variance and denominator rows are
    the whole row's."""
    docs = {} if segment_ids is None else {"segment_ids": segment_ids}
    exact = attention_lib.get("softmax")(q, k, v, mask=mask, causal=causal, **docs)
    rv = rows = None
    if isinstance(attn, attention_lib.RandomFeatureAttention):
        stats = None
        if (causal or docs) and attn.data_dependent:
            stats = attn.statistics(q, k, mask, mask)        # a diagnostic: fitted on the batch itself
        draw = attn.base_draw(key, q.shape[-1]) if own_draw is None else own_draw
        out = attn(q, k, v, mask=mask, causal=causal, draw=draw, query_mask=mask, stats=stats, **docs)
        ctx = attn.context(q, k, mask, None, None, mask, draw, stats, causal)
        rv = _relative_variance(attn, q, k, mask, ctx)
        if not attn.positive:
            rows = tuple(jnp.swapaxes(r, 1, 2) for r in attn.denominator_rows(q, k, mask, causal, ctx))
    else:
        out = attn(q, k, v, mask=mask, causal=causal, **docs)
    diff = jnp.sum(jnp.square(out.astype(jnp.float32) - exact.astype(jnp.float32)), -1)
    return diff, rv, rows


def pairs_of(kinds, num_features=(None,)) -> list[tuple]:
    """[(spec, M)]: every random-feature kind of `kinds` at each M of `num_features` (None: the run's), the
    other kinds once."""
    out = []
    for spec in kinds:
        kind = attention_lib.get(attention_lib.parse_spec(spec)[0])
        ms = num_features if isinstance(kind, attention_lib.RandomFeatureAttention) else (None,)
        out += [(spec, m) for m in ms]
    return out


def inspect(workdir, kinds=DEFAULT_KINDS, num_features=(None,), batches=4, seed=0, log=print, config=None,
            built=None) -> dict:
    """Per layer and head: relative error against softmax per kind (and M), query/key norms, relative
    variance. Returns a JSON-ready dict; `log` gets one line per batch. `config`: a model to build in
    `workdir` from its `init_from` instead of the run there (load); `built`: [(label, attention)] in place
    of kinds × num_features (labels must differ)."""
    config, module, data, task = load(workdir, config)
    layers = _layers(module)
    run_block = dict(config.model.attention)
    built = [_build(spec, m, run_block) for spec, m in pairs_of(kinds, num_features)] if built is None else built
    labels = [label for label, _ in built]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two settings carry one label: {', '.join(labels)}")
    # the run's own kind, as it ran, on a run that keeps one draw: figures on the ω its layers store
    as_run = _build(run_block["kind"], None, run_block)[1].options
    own = {label for label, attn in built if isinstance(attn, attention_lib.RandomFeatureAttention)
           and not attn.schedule.redraws and attention_lib.block_redraw(run_block) == "fixed"
           and attn.name == run_block["kind"] and attn.num_features == run_block.get("num_features")
           and attn.options == as_run}
    heads = layers[0][1].heads
    zeros = lambda: np.zeros((len(layers), heads))
    err2 = {label: zeros() for label, _ in built}
    var = {label: zeros() for label, _ in built}
    has_var = {label: True for label, _ in built}
    nonpositive = {label: zeros() for label, attn in built if not getattr(attn, "positive", True)}
    below = {label: zeros() for label in nonpositive}
    ref2, nq, nk, mq, mk, count, seen = zeros(), zeros(), zeros(), zeros(), zeros(), zeros(), 0
    base = jax.random.PRNGKey(seed)
    for batch in data:
        if seen >= batches:
            break
        _, captured = nnx.capture(lambda m, b: task.eval_outputs(m, b), nnx.Intermediate)(module, batch)
        for li, (path, layer) in enumerate(layers):
            node = captured
            for p in path:
                node = node[p]
            x, mask, positions, segment_ids, _ = node["transfer"].get_value()[0]
            length = x.shape[1]
            q, k, v = layer.project(x, positions)
            tokens = jnp.ones(x.shape[:2], bool) if mask is None else jnp.asarray(mask, bool)
            if "valid" in batch:
                tokens = tokens & jnp.asarray(batch["valid"], bool)[:, None]
            w = np.asarray(tokens, np.float64)[:, :, None]                                  # [B, L, 1]
            docs = {} if segment_ids is None else {"segment_ids": segment_ids}
            exact = attention_lib.get("softmax")(q, k, v, mask=mask, causal=layer.causal, **docs)
            ref2[li] += np.sum(np.square(np.asarray(exact, np.float64)).sum(-1) * w, (0, 1))
            s = layer.head_dim ** -0.25
            norm = lambda t: np.linalg.norm(np.asarray(t, np.float64) * s, axis=-1)         # [B, L, H]
            nq[li] += np.sum(norm(q) * w, (0, 1))
            nk[li] += np.sum(norm(k) * w, (0, 1))
            mq[li] = np.maximum(mq[li], np.max(np.where(w > 0, norm(q), 0.0), (0, 1)))
            mk[li] = np.maximum(mk[li], np.max(np.where(w > 0, norm(k), 0.0), (0, 1)))
            count[li] += np.sum(w)
            key = jax.random.fold_in(jax.random.fold_in(base, li), seen)
            for label, attn in built:
                stored = layer.features.get_value() if label in own and layer.features is not None else None
                diff, rv, rows = _kind_figures(attn, layer.causal, q, k, v, mask, key, stored, segment_ids)
                err2[label][li] += np.sum(np.asarray(diff, np.float64) * w, (0, 1))
                if rows is not None:
                    nonpositive[label][li] += np.sum(np.asarray(rows[0], np.float64) * w, (0, 1))
                    below[label][li] += np.sum(np.asarray(rows[1], np.float64) * w, (0, 1))
                if rv is None:
                    has_var[label] = False
                else:
                    var[label][li] += np.asarray(rv)
        seen += 1
        log(f"batch {seen}/{batches}")
    if not seen:
        raise ValueError(f"{workdir}: the evaluation split gave no batch")
    result = {"workdir": str(workdir), "batches": seen, "layers": len(layers), "heads": heads,
              "head_dim": layers[0][1].head_dim, "causal": bool(layers[0][1].causal), "length": int(length),
              "own_draw": sorted(own),
              "query_norm": (nq / np.maximum(count, 1)).tolist(), "key_norm": (nk / np.maximum(count, 1)).tolist(),
              "query_norm_max": mq.tolist(), "key_norm_max": mk.tolist(), "kinds": {}}
    for label, _ in built:
        rel = np.sqrt(err2[label] / np.maximum(ref2, 1e-30))
        result["kinds"][label] = {"relative_error": rel.tolist(),
                                  "relative_variance": (var[label] / seen).tolist() if has_var[label] else None}
        if label in nonpositive:
            result["kinds"][label]["nonpositive_fraction"] = (nonpositive[label] / np.maximum(count, 1)).tolist()
            result["kinds"][label]["below_floor_fraction"] = (below[label] / np.maximum(count, 1)).tolist()
    return result


def _grid(values, fmt):
    return ["  layer {:<3} ".format(i) + " ".join(fmt(v) for v in row) for i, row in enumerate(values)]


def report(result) -> str:
    """The printed report: norms, then per kind the error (and variance) grids, layers × heads."""
    h = result["heads"]
    head = "  " + " " * 10 + " ".join(f"{'head ' + str(j):>9}" for j in range(h))
    f = lambda v: f"{v:9.3f}"
    g = lambda v: f"{v:9.3g}"
    lines = [f"{result['workdir']}: {result['layers']} attention layers × {h} heads, {result['batches']} eval batches",
             "", "scaled query norm ‖q‖/D^¼ (mean / max over valid tokens)", head]
    lines += _grid([[f"{a:.2f}/{b:.2f}" for a, b in zip(r, m)] for r, m in
                    zip(result["query_norm"], result["query_norm_max"])], lambda s: f"{s:>9}")
    lines += ["", "scaled key norm ‖k‖/D^¼ (mean / max)", head]
    lines += _grid([[f"{a:.2f}/{b:.2f}" for a, b in zip(r, m)] for r, m in
                    zip(result["key_norm"], result["key_norm_max"])], lambda s: f"{s:>9}")
    for label, r in result["kinds"].items():
        lines += ["", f"{label}: relative error of the attention output against softmax", head]
        lines += _grid(r["relative_error"], f)
        if r["relative_variance"] is not None:
            lines += [f"{label}: mean relative variance Var[Ŝ]/exp(xᵀy)² (iid formula)", head]
            lines += _grid(r["relative_variance"], g)
        if r.get("nonpositive_fraction") is not None:
            lines += [f"{label}: fraction of rows whose estimated denominator is ≤ 0 / below the floor", head]
            lines += _grid([[f"{a:.3f}/{b:.3f}" for a, b in zip(n, f_)] for n, f_ in
                            zip(r["nonpositive_fraction"], r["below_floor_fraction"])], lambda s: f"{s:>9}")
    summary = sorted((float(np.mean(r["relative_error"])), label) for label, r in result["kinds"].items())
    lines += ["", "mean relative error over layers and heads:"]
    lines += [f"  {label:<28} {e:.4f}" for e, label in summary]
    return "\n".join(lines)


def plot(result, path):
    """One heatmap per kind (layers × heads, colour = relative error, one shared colour scale)."""
    # plotting loads matplotlib only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    kinds = list(result["kinds"])
    values = [np.asarray(result["kinds"][k]["relative_error"]) for k in kinds]
    positive = [v[v > 0] for v in values]
    lo = min((p.min() for p in positive if p.size), default=1e-3)
    hi = max((v.max() for v in values), default=1.0)
    norm = LogNorm(vmin=max(lo, 1e-4), vmax=max(hi, lo * 10, 1e-3))
    cols = min(len(kinds), 4)
    rows = math.ceil(len(kinds) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1.2, 1.0 + (1.6 + 0.4 * result["layers"]) * rows),
                             squeeze=False, layout="constrained")
    for ax, label, v in zip(axes.flat, kinds, values):
        im = ax.imshow(np.maximum(v, norm.vmin), norm=norm, cmap="viridis", aspect="auto")
        ax.set_title(f"{label}\nmean {v.mean():.3g}", fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(v.shape[1]))
        ax.set_yticks(range(v.shape[0]))
        for (i, j), e in np.ndenumerate(v):
            ax.text(j, i, f"{e:.2g}", ha="center", va="center", fontsize=7,
                    color="white" if e < math.sqrt(norm.vmin * norm.vmax) else "black")
    for ax in list(axes.flat)[len(kinds):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), label="‖Y − Y_softmax‖ / ‖Y_softmax‖")
    fig.suptitle(f"Attention error against exact softmax, per layer and head\n{Path(result['workdir']).name}, "
                 f"{result['batches']} eval batches", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m favor.tools.inspect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="a favor run (its checkpoints/ are read)")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                   help="comma-separated kind[:variant][@window] (default: %(default)s)")
    p.add_argument("--num_features", default="",
                   help="comma-separated M values for the random-feature kinds (default: the run's)")
    p.add_argument("--batches", type=int, default=4, help="evaluation batches to feed (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random features (default: %(default)s)")
    p.add_argument("--plot", default="", help="write a heatmap per kind to this PNG")
    p.add_argument("--json", default="", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    try:
        kinds = [spec for spec, _, _ in attention_lib.parse_specs("--kinds", args.kinds)] if args.kinds else []
        ms = strings.positive_ints("--num_features", args.num_features, nonempty=False) or [None]
        if args.batches < 1:
            raise ValueError(f"--batches must be ≥ 1; got {args.batches}")
        if not (Path(args.workdir) / "checkpoints").is_dir():
            raise ValueError(f"--workdir {args.workdir}: no checkpoints/ there (a favor run's directory)")
        result = inspect(args.workdir, kinds, ms, args.batches, args.seed, log=lambda s: print(s, file=sys.stderr))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(result))
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
