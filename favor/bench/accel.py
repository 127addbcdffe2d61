"""`python -m favor.bench accel`: every kind (on XLA, and through the fused Pallas kernel where it has one)
against softmax through `jax.nn.dot_product_attention` (cuDNN's flash attention on a GPU in bf16/fp16, XLA's
elsewhere), causal and bidirectional, forward and forward+backward, over lengths, dtypes and head dims;
time beside each program's planned peak memory, the length from which FAVOR+ is faster than softmax, and
a decoder training step's tokens/s. Every configuration's programs are timed round-robin (each round runs
them all once in a fresh random order), so the ratios compare programs measured side by side."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

from favor import attention, runtime
from favor.attention import fused, kinds as kinds_lib
from favor.bench import sections
from favor.bench.common import choices, ints, peak_bytes, round_robin, specs

KINDS = ("favor+", "favor++", "favor#", "simrf", "favor", "hrf", "relu", "elu")
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
F = 256            # feature width of every random-feature kind
WIDTH = 1024       # model width: heads = WIDTH / head dim
# the decoder whose training step is timed: favor's decoder at GPT-2 small's width, 4 layers
DECODER = dict(hidden=768, heads=12, num_layers=4, mlp_dim=2048)


def _softmax_impl(dtype):
    return "cudnn" if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"


def entries(kind_specs, precisions=(fused.PRECISION,)):
    """[(name, spec, impl)]: softmax first, then each kind on XLA and, where it has one, on the kernel
    (impl 'pallas' at the first of `precisions`, 'pallas-<precision>' at each other: fused.PRECISIONS)."""
    out = [("softmax", "softmax", None)]
    for spec in kind_specs:
        kind, opts = attention.parse_spec(spec)
        if kind == "softmax":
            continue
        out.append((f"{spec}/xla", spec, "xla"))
        attn = attention.get(kind, **opts)
        if isinstance(attn, kinds_lib.RandomFeatureAttention) and attn.fused_unavailable() is None:
            out.append((f"{spec}/pallas", spec, "pallas-" + precisions[0]))
            out += [(f"{spec}/pallas-{p}", spec, "pallas-" + p) for p in precisions[1:]]
    return out


def layer(spec, impl, dtype, causal, grad, q, k, mask=None):
    """fn(q, k, v, rng) of one entry: the layer's output, or d/d(q, k, v) of its sum (float32)."""
    if spec == "softmax":
        which = _softmax_impl(dtype)
        out = lambda q, k, v, rng: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=which)
    else:
        kind, opts = attention.parse_spec(spec)
        base = attention.get(kind)
        if "num_features" in base.OPTIONS:
            opts = {"num_features": F, "redraw": "step", "impl": impl, **opts}
        attn = attention.get(kind, **opts)
        stats = attn.statistics(q, k) if causal and getattr(attn, "data_dependent", False) else None
        out = lambda q, k, v, rng: attn(q, k, v, mask=mask, causal=causal, rng=rng, stats=stats)
    if not grad:
        return out
    return lambda q, k, v, rng: jax.grad(lambda *a: jnp.sum(out(*a, rng).astype(jnp.float32)), (0, 1, 2))(q, k, v)


def error_text(e):
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ("out of memory" if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text.lower()
            else text[:120])


def compile_all(lowered):
    """{name: jax Lowered} -> {name: compiled program, or the exception compiling it raised}, compiled in
    parallel threads: XLA's compiler releases the GIL, and on an accelerator host compiling (~10 s a
    program on the H200 measured) is most of the benchmark's time. Tracing (`lower`) stays the caller's,
    one program at a time: the kernel's precision is a module setting read while tracing."""
    def one(low):
        try:
            return low.compile()
        except Exception as e:                                     # noqa: BLE001 — the caller reports it
            return e
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
        jobs = {name: pool.submit(one, low) for name, low in lowered.items()}
    return {name: job.result() for name, job in jobs.items()}


def ready(lowered, args):
    """({name: compiled program, called once on its arguments}, {name: why it failed}) of {name: jax
    Lowered}; `args`: the arguments of every program, or {name: its arguments}. Compiled in parallel
    (`compile_all`); a program that fails to compile or to run (out of memory, say) is reported, not raised."""
    programs, failed = {}, {}
    for name, compiled in compile_all(lowered).items():
        try:
            if isinstance(compiled, Exception):
                raise compiled
            jax.block_until_ready(compiled(*(args[name] if isinstance(args, dict) else args)))   # warm
            programs[name] = compiled
        except Exception as e:                                     # noqa: BLE001 — reported, not hidden
            failed[name] = error_text(e)
    return programs, failed


def measure(config, names, rounds, skip, seed=0):
    """One configuration (dtype, head_dim, causal, grad, length, batch): every entry compiled (its planned
    peak bytes from XLA's memory analysis), then timed round-robin. `skip` {name: why} leaves entries out.
    Returns {name: {"min_ms", "median_ms", "peak_mb", "ratio"} or {"error"}}."""
    dtype, d, causal, grad, length, batch = config
    heads = max(1, WIDTH // d)
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k, v = ((0.5 * jax.random.normal(kk, (batch, length, heads, d))).astype(dtype) for kk in ks[:3])
    args = (q, k, v, ks[3])
    results, lowered = {}, {}
    for name, spec, impl in names:
        if name in skip:
            results[name] = {"error": skip[name]}
            continue
        try:   # traced one at a time (the kernel's precision is read while tracing)
            lowered[name] = jax.jit(layer(spec, impl, dtype, causal, grad, q, k)).lower(*args)
        except Exception as e:                                     # noqa: BLE001 — reported, not hidden
            results[name] = {"error": error_text(e)}
    programs, failed = ready(lowered, args)
    results.update({name: {"error": why} for name, why in failed.items()})
    for name, compiled in programs.items():
        peak = peak_bytes(compiled)
        results[name] = {"peak_mb": None if peak is None else peak / 2 ** 20}
    results = {name: results[name] for name, *_ in names if name in results}       # the entries' order
    times = round_robin({name: (p, args, 1.0) for name, p in programs.items()}, rounds, seed, warm=False)
    base = times.get("softmax")
    for name, t in times.items():
        results[name].update(min_ms=min(t) * 1e3, median_ms=statistics.median(t) * 1e3)
        if base:
            results[name]["ratio"] = statistics.median(a / b for a, b in zip(t, base))
    del programs
    return results


def check(kind_specs, precisions=(fused.PRECISION,), length=1000, seed=0):
    """The fused kernel against favor's XLA pass (at full float32 matmul precision) on this device, float32
    inputs, for each kind it covers and
    each kernel precision, causal and bidirectional: the largest difference of the outputs and of
    d/d(q, k, v) relative to the largest XLA value, at L = `length` (not a multiple of the chunk), B = 2, H = 4,
    D = 64, keys padded; and whether replacing the tokens from 70 % of L on leaves the causal outputs before
    them the same, bit for bit."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q, k, v = (0.5 * jax.random.normal(kk, (2, length, 4, 64)) for kk in ks[:3])
    mask = jnp.ones((2, length), bool).at[0, -37:].set(False).at[1, :50].set(False)
    w = jax.random.normal(ks[3], v.shape)
    cut = int(0.7 * length)
    q2, k2, v2 = (a.at[:, cut:].set(jax.random.normal(ks[4], a[:, cut:].shape)) for a in (q, k, v))
    # every program lowered first (each under its matmul precision), then compiled in parallel threads: on an
    # accelerator compiling is most of the check's time
    jobs = [(name, spec, impl, causal) for name, spec, impl in entries(kind_specs, precisions)
            if (impl or "").startswith("pallas") for causal in (False, True)]
    lowered, failed = {}, {}
    for _, spec, impl, causal in jobs:
        for which in ("xla", impl):
            key = (spec, which, causal)
            if key in lowered or key in failed:
                continue
            try:
                lowered[key] = _check_programs(spec, which, causal, q, k, v, mask, w)
            except Exception as e:                                 # noqa: BLE001 — reported, not hidden
                failed[key] = error_text(e)
    flat = compile_all({(*key, part): low for key, pair in lowered.items() for part, low in zip(("out", "grad"), pair)})
    rows = []
    for name, spec, impl, causal in jobs:
        try:
            for which in ("xla", impl):
                if (spec, which, causal) in failed:
                    raise RuntimeError(failed[(spec, which, causal)])
            row = _check_one({which: (flat[(spec, which, causal, "out")], flat[(spec, which, causal, "grad")])
                              for which in ("xla", impl)}, impl, causal, q, k, v, (q2, k2, v2), cut)
        except Exception as e:                                     # noqa: BLE001 — reported, not hidden
            row = {"error": error_text(e)}
        row = {"kind": name, "causal": causal, **row}
        rows.append(row)
        print(f"check {name} {'causal' if causal else 'bidir'}: " + (
            row["error"] if "error" in row else f"out {row['out']:.1e}, grad {row['grad']:.1e}"
            + (f", future never moves the past: {row['causal_bitwise']}" if causal else "")), flush=True)
    return rows


def _check_programs(spec, which, causal, q, k, v, mask, w):
    """(outputs, d/d(q, k, v) of Σ w·outputs) of one kind on one impl, lowered. XLA's (the reference) at
    full float32 precision: an accelerator's default runs XLA's float32 matmuls on TF32 or bf16 passes (on
    an H200 favor+'s XLA pass then differs from its own float32 by 7e-4)."""
    fwd = layer(spec, which, jnp.float32, causal, False, q, k, mask)
    with jax.default_matmul_precision("highest" if which == "xla" else "default"):
        return (jax.jit(lambda q, k, v: fwd(q, k, v, None)).lower(q, k, v),
                jax.jit(jax.grad(lambda q, k, v: jnp.sum(w * fwd(q, k, v, None)), (0, 1, 2))).lower(q, k, v))


def _check_one(programs, impl, causal, q, k, v, changed, cut):
    """One kind, precision and mode of `check` from its compiled programs ({impl: (outputs, gradients)}, each
    compiled or the exception compiling it raised): XLA's outputs and gradients against the kernel's."""
    for compiled in (p for pair in programs.values() for p in pair):
        if isinstance(compiled, Exception):
            raise compiled
    rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    got = {which: (out(q, k, v), grads(q, k, v)) for which, (out, grads) in programs.items()}
    x, p = got["xla"], got[impl]
    row = {"out": rel(x[0], p[0]), "grad": max(rel(a, b) for a, b in zip(x[1], p[1]))}
    if causal:
        row["causal_bitwise"] = bool(jnp.all(programs[impl][0](*changed)[:, :cut] == p[0][:, :cut]))
    return row


def crossover(rows, entry):
    """The shortest length from which `entry` is faster than softmax at every measured length (None if
    it never is, or was not measured)."""
    lengths = sorted(r["length"] for r in rows if "ratio" in r["results"].get(entry, {}))
    won = {r["length"]: r["results"][entry]["ratio"] < 1.0 for r in rows if "ratio" in r["results"].get(entry, {})}
    best = None
    for length in reversed(lengths):
        if not won[length]:
            break
        best = length
    return best


def run(kind_specs, precisions, lengths, dtypes, head_dims, modes, passes, tokens, rounds, budget, max_ms,
        progress=None):
    """Every configuration, each timed by `measure`; `progress(names, rows)` after each (the section is
    written as it grows, so a run stopped from outside keeps what it measured)."""
    names = entries(kind_specs, precisions)
    rows, start, given_up = [], time.perf_counter(), {}
    # lengths outside modes and passes: a spent budget leaves out the longest lengths of every mode, not
    # whole modes
    for dtype in dtypes:
        for d in head_dims:
            for length in lengths:
                for causal in modes:
                    for grad in passes:
                        group = (dtype, d, causal, grad)
                        config = (dtype, d, causal, grad, length, max(1, tokens // length))
                        if time.perf_counter() - start > budget:
                            rows.append({"config": config, "length": length, "results": {},
                                         "note": "not run: the time budget was spent"})
                            continue
                        skip = {n: why for (g, n), why in given_up.items() if g == group}
                        results = measure(config, names, rounds, skip)
                        for n, r in results.items():
                            if "error" in r and (group, n) not in given_up:
                                given_up[(group, n)] = f"{r['error']} at L = {length}"
                            elif r.get("median_ms", 0) > max_ms and (group, n) not in given_up:
                                given_up[(group, n)] = f"over {max_ms:g} ms at L = {length}"
                        rows.append({"config": config, "length": length, "results": results})
                        print(_row_text(config, results), flush=True)
                        if progress:
                            progress(names, rows)
    return names, rows


def _row_text(config, results):
    dtype, d, causal, grad, length, batch = config
    cells = []
    for name, r in results.items():
        cells.append(f"{name} " + ("—" if "median_ms" not in r else f"{r['median_ms']:.2f}ms"
                                   + (f" ({r['ratio']:.2f}x)" if "ratio" in r and name != "softmax" else "")))
    mode = ("causal" if causal else "bidir") + ("+grad" if grad else "")
    return f"{jnp.dtype(dtype).name} D={d} {mode} L={length} B={batch}: " + ", ".join(cells)


def decoder_steps(kind_specs, precisions, lengths, rounds, dtype, tokens):
    """Tokens per second of a decoder training step (favor's decoder 'mini' layout at DECODER's sizes,
    AdamW) at each length, softmax against each kind, timed round-robin."""
    import optax
    from flax import nnx

    from favor import models
    rows = []
    for length in lengths:
        batch = max(1, tokens // length)
        ids = jax.random.randint(jax.random.PRNGKey(0), (batch, length), 0, 4000)
        lowered, inputs, failed = {}, {}, {}
        for name, spec, impl in entries(kind_specs, precisions):
            kind, opts = attention.parse_spec(spec)
            block = {"kind": kind, **opts}
            if kind != "softmax":
                block.update(num_features=F, impl=impl)
            else:
                block.update(impl=_softmax_impl(dtype))            # cuDNN where it applies, as in the grid
            try:
                model = models.get("decoder", "mini", **DECODER, max_positions=length, attention=block,
                                   dtype=jnp.dtype(dtype).name, rngs=nnx.Rngs(0))
                graphdef, params, rest = nnx.split(model, nnx.Param, ...)
                tx = optax.adamw(1e-4)

                @jax.jit
                def step(params, opt_state, rest, ids, graphdef=graphdef, tx=tx):
                    def loss(params):
                        logits = nnx.merge(graphdef, params, rest)(ids[:, :-1])["logits"]
                        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
                    value, grads = jax.value_and_grad(loss)(params)
                    updates, opt_state = tx.update(grads, opt_state, params)
                    return optax.apply_updates(params, updates), opt_state, value
                state = (params, tx.init(params), rest)
                lowered[name] = step.lower(*state, ids)
                inputs[name] = (*state, ids)
            except Exception as e:                                 # noqa: BLE001 — reported, not hidden
                failed[name] = error_text(e)
        programs, why = ready(lowered, inputs)
        failed.update(why)
        # every round runs a step from the same state: the computation of a run's next step
        times = round_robin({n: (p, inputs[n], 1.0) for n, p in programs.items()}, rounds, 0, warm=False)
        res = {n: ({"error": failed[n]} if n in failed else
                   {"tokens_per_s": batch * (length - 1) / statistics.median(times[n]),
                    "ratio": statistics.median(a / b for a, b in zip(times[n], times["softmax"]))
                    if "softmax" in times else None})
               for n, *_ in entries(kind_specs, precisions)}
        rows.append({"length": length, "batch": batch, "results": res})
        print(f"decoder L={length} B={batch}: " + ", ".join(
            f"{n} {r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r else f"{n} —" for n, r in res.items()),
            flush=True)
    return rows


def plot(rows, names, path, title):
    """Milliseconds per 1,000 tokens against length, log-log: one panel per mode and pass measured (the
    first dtype and head dim). Per token, because B = tokens / L changes with L: a linear-time attention
    is then flat, softmax rises."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    first = tuple(rows[0]["config"][:2])
    measured = lambda r: [n for n in names if "median_ms" in r["results"].get(n, {})]
    panels = [(c, g) for c in (False, True) for g in (False, True)
              if any(tuple(r["config"][:4]) == (*first, c, g) and measured(r) for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, (causal, grad) in zip(axes[0], panels):
        sub = [r for r in rows if tuple(r["config"][:4]) == (*first, causal, grad)]
        for name in names:
            # in length order: a run may measure its lengths in any order (the budget cuts the last ones)
            pts = sorted((r["length"], 1e3 * r["results"][name]["median_ms"] / (r["config"][5] * r["length"]))
                         for r in sub if "median_ms" in r["results"].get(name, {}))
            if pts:
                ax.plot(*zip(*pts), "--" if name.endswith("/xla") else "-", marker="o", ms=3, label=name,
                        lw=2.2 if name == "softmax" else 1.2)
        ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="ms per 1,000 tokens",
               title=("causal" if causal else "bidirectional") + (", forward+backward" if grad else ", forward"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(json_path):
    """The plot of a run's raw figures (bench/<section>.json) again, beside it."""
    import json
    data = json.loads(pathlib.Path(json_path).read_text())
    rows = [r for r in data["rows"] if r["results"]]
    names = list(dict.fromkeys(n for r in rows for n in r["results"]))
    meta = data["meta"]
    plot(rows, names, pathlib.Path(json_path).with_suffix(".png"),
         f"favor attention against softmax, {sections.where(meta)}, B = max(1, {meta['tokens']} / L)")


def write(names, rows, dec_rows, checks, meta, out_dir, section, with_plot=True):
    def cell(r):
        if "median_ms" not in r:
            return f"— ({r['error']})" if "error" in r else "—"
        ratio = f" ({r['ratio']:.2f}×)" if "ratio" in r and r["ratio"] != 1.0 else ""
        mem = "" if r.get("peak_mb") is None else f", {r['peak_mb']:.0f} MB"
        return f"{r['median_ms']:.2f} ms{ratio}{mem}"
    cols = [n for n, *_ in names]
    lines = ["| dtype | D | mode | L | B | " + " | ".join(cols) + " |", "|---" * (5 + len(cols)) + "|"]
    for r in sorted(rows, key=lambda r: (str(r["config"][0]), r["config"][1], r["length"])):   # stable: modes stay
        dtype, d, causal, grad, length, batch = r["config"]
        mode = ("causal" if causal else "bidir") + ("+grad" if grad else "")
        body = [r.get("note", "")] if "note" in r else [cell(r["results"].get(n, {})) for n in cols]
        lines.append(f"| {jnp.dtype(dtype).name} | {d} | {mode} | {length} | {batch} | " + " | ".join(body) + " |")
    groups = sorted({r["config"][:4] for r in rows}, key=str)
    cross = ["| dtype | D | mode | " + " | ".join(c for c in cols if c != "softmax") + " |",
             "|---" * (3 + len(cols) - 1) + "|"]
    for g in groups:
        sub = [r for r in rows if r["config"][:4] == g]
        dtype, d, causal, grad = g
        mode = ("causal" if causal else "bidir") + ("+grad" if grad else "")
        vals = []
        for c in cols:
            if c == "softmax":
                continue
            x = crossover(sub, c)
            vals.append("never" if x is None else f"L ≥ {x}")
        cross.append(f"| {jnp.dtype(dtype).name} | {d} | {mode} | " + " | ".join(vals) + " |")
    text = (f"{sections.heading(section, meta)}\n\n"
            f"{sections.where(meta)}. Softmax is `jax.nn.dot_product_attention` "
            f"({'cuDNN flash attention in bf16/fp16, XLA in float32' if meta['backend'] == 'gpu' else 'XLA'}); "
            f"every random-feature kind at F = {F} features, redrawn every call ('/xla': favor's XLA pass at the "
            f"device's default matmul precision; '/pallas': the fused kernel with "
            + ("IEEE float32 products, as interpret mode runs every precision" if meta["backend"] == "cpu" else
               f"{meta.get('kernel_precisions', ['highest'])[0]} products, '/pallas-P' with P's")
            + f"); heads = {WIDTH} / D; "
            f"B = {meta['tokens']} / L tokens per batch (at least 1). Each cell: the median ms per call, the "
            f"median of the per-round ratios to softmax in parentheses, and XLA's planned peak memory of the "
            f"program (arguments, outputs and temporaries). {meta['rounds']} rounds, round-robin. "
            f"'—': not run (the reason given: an error, or the entry was over {meta['max_ms']:g} ms at a shorter "
            f"length). Raw figures: bench/{section}.json; plot: bench/{section}.png."
            + (" On a CPU the kernel ('/pallas') runs in Pallas interpret mode, an emulator: its times say nothing "
               "of the kernel's speed; the check still holds (the kernel's arithmetic is the same)."
               if meta["backend"] == "cpu" else "") + "\n\n"
            + "\n".join(lines) + "\n\nThe length from which each entry is faster than softmax at every measured "
            "length:\n\n" + "\n".join(cross))
    if dec_rows:
        dcols = list(dec_rows[0]["results"])
        dl = ["| L | B | " + " | ".join(dcols) + " |", "|---" * (2 + len(dcols)) + "|"]
        for r in dec_rows:
            dl.append(f"| {r['length']} | {r['batch']} | " + " | ".join(
                f"{v['tokens_per_s']:,.0f} tok/s" + (f" ({v['ratio']:.2f}× softmax's time)" if v.get("ratio") else "")
                if "tokens_per_s" in v else f"— ({v['error']})" for v in r["results"].values()) + " |")
        text += (f"\n\nA decoder training step ({DECODER['num_layers']} layers of width {DECODER['hidden']}, "
                 f"{DECODER['heads']} heads, SwiGLU {DECODER['mlp_dim']}, AdamW; "
                 f"{meta['decoder_dtype']}), tokens per second, timed round-robin:\n\n" + "\n".join(dl))
    if checks:
        cl = ["| kind | mode | outputs | gradients | future never moves the past |", "|---|---|---|---|---|"]
        cl += [f"| {c['kind']} | {'causal' if c['causal'] else 'bidir'} | " + (
            f"— ({c['error']}) | | |" if "error" in c else
            f"{c['out']:.1e} | {c['grad']:.1e} | {('bit for bit' if c['causal_bitwise'] else 'NO') if c['causal'] else ''} |")
            for c in checks]
        text += ("\n\nThe fused kernel against the XLA pass at full float32 matmul precision on this device "
                 f"(float32, L = {meta.get('check_length', 1000)}, B = 2, H = 4, D = 64, padded keys; 'future "
                 "never moves the past': the tokens from 70 % of L on replaced): the largest difference relative to "
                 "the largest XLA value:\n\n" + "\n".join(cl))
    payload = {"meta": meta, "checks": checks, "rows": [{**r, "config": [str(r["config"][0]), *r["config"][1:]]} for r in rows],
               "decoder": dec_rows}
    sections.publish(out_dir, section, text, payload)
    png = pathlib.Path(out_dir) / "bench" / f"{section}.png"
    if with_plot and rows and any(r["results"] for r in rows):
        plot(rows, [n for n, *_ in names], png,
             f"favor attention against softmax, {sections.where(meta)}, B = max(1, {meta['tokens']} / L)")


def add_parser(sub):
    p = sub.add_parser("accel", help="every kind (XLA and the fused kernel) against softmax/FlashAttention "
                                     "over lengths; the crossover length; decoder tokens/s")
    p.add_argument("--kinds", default=",".join(KINDS), help="kind specs (default: %(default)s)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--modes", default="causal,bidir")
    p.add_argument("--passes", default="fwd,grad", help="fwd (forward), grad (forward+backward)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens / L, at least 1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=3000.0, help="seconds: configurations after it are not run")
    p.add_argument("--max-ms", type=float, default=5000.0,
                   help="an entry slower than this at one length is not run at longer ones")
    p.add_argument("--decoder-lengths", default="", help="decoder training step lengths (none by default)")
    p.add_argument("--decoder-kinds", default="favor+")
    p.add_argument("--kernel-precisions", default=fused.PRECISION,
                   help="the fused kernel's product precisions to measure, the first as '<kind>/pallas' "
                        "(favor.attention.fused.PRECISIONS; default: %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="first check the fused kernel against XLA on this device (outputs, gradients, causality)")
    p.add_argument("--check-length", type=int, default=1000, help="the check's sequence length")
    p.add_argument("--quick", action="store_true",
                   help="CPU-sized: L = 128, 256; favor+ and favor# only; D = 64; 2 rounds; decoder at L = 128")
    p.add_argument("--out", default=None,
                   help="where BENCHMARKS.md and bench/ are (default: '.', the committed figures from the checkout's "
                        "root; with --quick a new temporary directory, so a smoke run never replaces them)")
    p.add_argument("--section", default=None, help="default: accel-<device>")
    p.add_argument("--section-suffix", default="", help="appended to the section's name")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only draw the plot of a run's raw figures (bench/<section>.json) again")


def main(args, flags, argv, parser):
    if args.replot:
        return replot(args.replot)
    kinds = specs(parser, "--kinds", args.kinds)
    lengths, head_dims = ints(parser, "--lengths", args.lengths), ints(parser, "--head-dims", args.head_dims)
    dtypes = [jnp.dtype(x) for x in choices(parser, "--dtypes", args.dtypes, ("bfloat16", "float32", "float16"))]
    modes = [m == "causal" for m in choices(parser, "--modes", args.modes, ("causal", "bidir"))]
    passes = [p == "grad" for p in choices(parser, "--passes", args.passes, ("fwd", "grad"))]
    dec_lengths = ints(parser, "--decoder-lengths", args.decoder_lengths) if args.decoder_lengths else []
    dec_kinds = specs(parser, "--decoder-kinds", args.decoder_kinds)
    rounds, tokens = args.rounds, args.tokens
    if args.quick:
        kinds, lengths, head_dims, rounds, tokens = ["favor+", "favor#"], [128, 256], [64], 2, 512
        dtypes = [jnp.dtype("float32")]
        dec_lengths = [128]
    precisions = tuple(choices(parser, "--kernel-precisions", args.kernel_precisions, tuple(fused.PRECISIONS)))
    runtime.keep_host_pages()
    device = "".join(c if c.isalnum() else "-" for c in jax.devices()[0].device_kind.lower())
    section = (args.section or ("accel-cpu" if jax.default_backend() == "cpu" else f"accel-{device}")) + args.section_suffix
    meta = sections.machine(argv, tokens=tokens, rounds=rounds, max_ms=args.max_ms, features=F, width=WIDTH,
                            decoder_dtype=jnp.dtype(dtypes[0]).name,
                            check_length=200 if args.quick else args.check_length, quick=args.quick)
    meta["kernel_precisions"] = list(precisions)
    out = sections.resolve_out(args.out, "accel", args.quick)
    checks = check(kinds, precisions, length=200 if args.quick else args.check_length) if args.check else []
    progress = lambda names, rows: write(names, rows, [], checks, meta, out, section, with_plot=False)
    names, rows = run(kinds, precisions, lengths, dtypes, head_dims, modes, passes, tokens, rounds, args.budget,
                      args.max_ms, progress)
    dec_rows = decoder_steps(dec_kinds, precisions, dec_lengths, rounds, dtypes[0], tokens) if dec_lengths else []
    write(names, rows, dec_rows, checks, meta, out, section)
    if args.out is None and args.quick:
        sections.said_quick(out, section)
