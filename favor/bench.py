"""Benchmarks: `python -m favor.bench attention [--lengths 512,1024] [--kinds favor+,softmax]` and
`python -m favor.bench train --config configs/<file>.py[:args] --metric wer --target 0.5 [-- FLAGS]` and
`python -m favor.bench parts [--length 8192]` (FAVOR+'s forward against the cost of its parts) and
`python -m favor.bench ratios [--length 8192] [--rounds 15] [--targets long|kinds|...]` (speed targets, timed
round-robin) and
`python -m favor.bench uptrain [--config configs/default.py]` (every kind started from a softmax run:
favor/bench_uptrain.py) and
`python -m favor.bench peers [--lengths 128,1024] [--modes bidirectional,causal]` (FAVOR+ against
performer-pytorch, round-robin: favor/bench_peers.py; needs the `bench` extra).

Every figure of one run is also written as a ratio to figures measured in the same run (machines are
shared and noisy; ratios travel, seconds do not): to exact softmax attention, and to a plain matmul
with the same FLOP count (XLA's cost analysis of the compiled kind; XLA counts a loop's body once, so a
bidirectional feature kind's FLOPs are counted on its one-chunk program: the same operations, not
split into a scan over chunks). Peak memory is XLA's compiled
buffer footprint (arguments + outputs + temporaries) of the jitted function.

Writes BENCHMARKS.md (the section between its markers is replaced) and bench/<section>.json.
A kind may carry its variant: `favor#:saderf`, `hrf:gaussian`, `simrf:oprf`.

`train` runs `train.py` as a user would (a fresh process, a fresh workdir) and records the eval
metric against wall-clock time: time-to-target is the one figure here in seconds, because the target
itself is a time ("WER below 50 % within 10 minutes on 2 CPU cores").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from favor import attention, bench_peers, runtime

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
B, H, D, M = 1, 4, 64, 256


def markers(section):
    return f"<!-- {section}:begin -->", f"<!-- {section}:end -->"


def _timed(fn, args, repeats, min_seconds=0.3):
    jax.block_until_ready(fn(*args))                  # warm (compiled already)
    times = []
    t_start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - t_start < min_seconds and len(times) < 50):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compile(fn, args):
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    peak = None if mem is None else int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                         + mem.temp_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float((cost or {}).get("flops", 0.0))
    return compiled, peak, flops


def memory_budget():
    """Half the machine's physical memory: what one compiled function may plan to use."""
    return 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def square_matmul(flops):
    """(jitted matmul, its arguments, the factor taking its time to `flops`): the square float32 matmul
    nearest `flops` (2n³) floating-point operations."""
    n = max(16, int(round((flops / 2.0) ** (1.0 / 3.0))))
    a = jnp.ones((n, n), jnp.float32)
    return jax.jit(lambda a, b: a @ b), (a, a), flops / (2.0 * n ** 3)


def matmul_seconds(flops, repeats):
    """Time of one square float32 matmul doing `flops` floating-point operations."""
    f, args, scale = square_matmul(flops)
    return _timed(f, args, repeats) * scale


def kind_options(spec):
    """'favor#:saderf' -> ('favor#', {..., variant: 'saderf'}): a kind plus its variant option;
    'favor+@64' adds a local window of 64 (favor.attention.window)."""
    spec, _, window = spec.partition("@")
    kind, _, variant = spec.partition(":")
    if window:
        kind, opts = kind_options(spec)
        return kind, {**opts, "window": int(window)}
    if kind in ("softmax", "relu", "elu"):
        return kind, {}
    opts = {"num_features": M, "redraw": "step"}     # one width for every kind (equal [L, F] cost)
    if variant:
        opts[{"favor#": "variant", "hrf": "lambda_", "simrf": "features"}.get(kind, "variant")] = variant
    return kind, opts


def flop_twin(kind, opts, length, causal):
    """The kind as its FLOPs are counted: XLA's cost analysis counts a while loop's body once (not
    times its trip count), so the bidirectional pass, a scan over chunks of keys and a map over
    chunks of queries, is counted on the same kind with one chunk of the whole length (the same
    operations in one trip). Causal and window passes keep their own chunks (their [C, C] blocks are
    part of the algorithm's work); their scan over spans of chunks is counted with one span of the
    whole length."""
    accepted = attention.get(kind).OPTIONS
    if "chunk_size" not in accepted:
        return attention.get(kind, **opts)
    if causal or opts.get("window"):
        return attention.get(kind, **{**opts, "causal_span": length})
    return attention.get(kind, **{**opts, "chunk_size": length})


def _flops(attn, causal, q, k, v, rng, stats, grad):
    def f(q, k, v, rng):
        out = lambda q, k, v: attn(q, k, v, causal=causal, rng=rng, stats=stats)
        return jax.grad(lambda *a: jnp.sum(out(*a)), argnums=(0, 1, 2))(q, k, v) if grad else out(q, k, v)
    return _compile(f, (q, k, v, rng))[2]


def setup(spec, length, causal):
    """(layer, its FLOP twin, (q, k, v, rng), stats) of one benchmarked kind."""
    kind, opts = kind_options(spec)
    attn = attention.get(kind, **opts)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (0.5 * jax.random.normal(kk, (B, length, H, D)) for kk in ks[:3])
    # causal data-dependent kinds fit on statistics from outside the sequence (what a causal model's
    # running statistics give): fitted once here, outside the timed function
    stats = attn.statistics(q, k) if causal and getattr(attn, "data_dependent", False) else None
    return attn, flop_twin(kind, opts, length, causal), (q, k, v, ks[3]), stats


def measure(spec, length, causal, repeats):
    attn, twin, (q, k, v, rng), stats = setup(spec, length, causal)

    def fwd(q, k, v, rng):
        return attn(q, k, v, causal=causal, rng=rng, stats=stats)

    def fwd_bwd(q, k, v, rng):
        return jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v, causal=causal, rng=rng, stats=stats)),
                        argnums=(0, 1, 2))(q, k, v)

    row = {"kind": spec, "length": length, "causal": causal}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        compiled, peak, flops = _compile(fn, (q, k, v, rng))
        if peak is not None and peak > memory_budget():
            # exact softmax at 16k: running it would get the process OOM-killed, losing the run
            row[name] = {"seconds": None, "peak_bytes": peak, "flops": flops, "matmul_seconds": None,
                         "skipped": f"needs {peak / 2 ** 30:.1f} GiB > budget {memory_budget() / 2 ** 30:.1f} GiB"}
            continue
        if twin is not attn:
            flops = _flops(twin, causal, q, k, v, rng, stats, grad=name == "fwd_bwd")
        seconds = _timed(compiled, (q, k, v, rng), repeats)
        row[name] = {"seconds": seconds, "peak_bytes": peak, "flops": flops,
                     "matmul_seconds": matmul_seconds(flops, repeats) if flops > 0 else None}
    return row


def run(kinds, lengths, repeats, out_dir, on_row=None):
    rows = []
    for length in lengths:
        for causal in (False, True):
            for kind in kinds:
                t0 = time.perf_counter()
                try:
                    row = measure(kind, length, causal, repeats)
                except Exception as e:   # e.g. out of memory for exact softmax at long L: recorded, not fatal
                    row = {"kind": kind, "length": length, "causal": causal, "error": f"{type(e).__name__}: {e}"[:200]}
                rows.append(row)
                if on_row is not None:
                    on_row(rows)        # written as it goes: a killed run keeps what it measured
                fwd = row.get("fwd", {}).get("seconds")
                print(f"L={length:>6} {'causal' if causal else 'bidir ':6} {kind:<8} "
                      f"fwd={fwd if fwd is None else f'{fwd * 1e3:9.2f}ms'} ({time.perf_counter() - t0:.0f}s)",
                      flush=True)
    return rows


# -- ratios: forward times of several programs measured round-robin --------------------------------------
# Issue 13's speed targets, each "numerator : denominator ≤ target". An entry is kind/mode; "matmul:kind/mode"
# is a square matmul with that entry's forward FLOP count (as in the attention table).
TARGETS = (("favor/bidir", "favor+/bidir", 2.5), ("hrf/bidir", "favor+/bidir", 2.5),
           ("favor+/bidir", "matmul:favor+/bidir", 2.0),
           *((f"{k}/causal", f"{k}/bidir", 1.5) for k in ("favor+", "simrf", "favor++", "favor#", "favor", "hrf",
                                                          "relu", "elu")),
           ("favor+@64/causal", "favor+/causal", 1.25), ("favor#@64/causal", "favor#/causal", 1.25))


# The costs of the kinds at one feature width (FAVOR++ and FAVOR# against FAVOR+, forward and
# forward+backward, bidirectional; trig and HRF): the targets of `--targets kinds`
KIND_TARGETS = tuple((f"{k}/bidir{g}", f"favor+/bidir{g}", t) for g in ("", "+grad")
                     for k, t in (("favor++", 1.15), ("favor#", 1.4), ("favor", 1.5), ("hrf", 1.5)))
TARGET_SETS = {"long": TARGETS, "kinds": KIND_TARGETS}


def _entry(text):
    """'favor#/bidir' -> ('favor#', causal False, matmul False, grad False); the mode may end in '+grad'
    (the forward and backward pass, as a training step runs it)."""
    spec, _, mode = text.rpartition("/")
    grad = mode.endswith("+grad")
    mode = mode.removesuffix("+grad")
    if mode not in ("bidir", "causal") or not spec:
        raise ValueError(f"ratio entry {text!r}: expected kind/bidir or kind/causal, optionally +grad (or "
                         f"matmul:kind/mode)")
    matmul = spec.startswith("matmul:")
    kind = spec[len("matmul:"):] if matmul else spec
    if kind.partition("@")[0].partition(":")[0] not in attention.names():
        raise ValueError(f"ratio entry {text!r}: unknown kind {kind!r}; valid: {', '.join(attention.names())}")
    return kind, mode == "causal", matmul, grad


def _forward(spec, length, causal, grad=False):
    """(compiled forward — or forward and backward with `grad` —, its arguments, its FLOPs) of one kind,
    set up as `measure` does."""
    attn, twin, args, stats = setup(spec, length, causal)
    fwd = lambda q, k, v, r: attn(q, k, v, causal=causal, rng=r, stats=stats)
    fn = (lambda q, k, v, r: jax.grad(lambda *a: jnp.sum(fwd(*a, r)), argnums=(0, 1, 2))(q, k, v)) if grad else fwd
    compiled, _, flops = _compile(fn, args)
    if twin is not attn:
        flops = _flops(twin, causal, *args, stats, grad=grad)
    return compiled, args, flops


def ratios(targets, length, rounds, seed=0):
    """Forward seconds of every entry of `targets`, timed round-robin: each round runs every program once
    in a fresh random order, so a burst of load on a shared machine falls on all of them alike. Per
    target: the ratio of the entries' minimum times and the median of the per-round ratios."""
    entries = sorted({e for n, d, _ in targets for e in (n, d)})
    parsed = {e: _entry(e) for e in entries}
    programs, flops = {}, {}          # entry -> (function, arguments, factor on its time)
    for e in entries:
        kind, causal, matmul, grad = parsed[e]
        if not matmul:
            fn, args, flops[e] = _forward(kind, length, causal, grad)
            programs[e] = (fn, args, 1.0)
    for e in entries:
        kind, causal, matmul, grad = parsed[e]
        if matmul:
            twin = e[len("matmul:"):]
            programs[e] = square_matmul(flops[twin] if twin in flops else _forward(kind, length, causal, grad)[2])
    times = {e: [] for e in entries}
    order = list(entries)
    rnd = random.Random(seed)
    for fn, args, _ in programs.values():
        jax.block_until_ready(fn(*args))                                   # warm
    for _ in range(rounds):
        rnd.shuffle(order)
        for e in order:
            fn, args, factor = programs[e]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[e].append((time.perf_counter() - t0) * factor)
    rows = []
    for num, den, target in targets:
        per_round = [a / b for a, b in zip(times[num], times[den])]
        rows.append({"numerator": num, "denominator": den, "target": target,
                     "ratio_of_minima": min(times[num]) / min(times[den]),
                     "median_ratio": statistics.median(per_round),
                     "rounds_within_target": sum(r <= target for r in per_round) / len(per_round)})
    return rows, {e: {"min_ms": min(t) * 1e3, "median_ms": statistics.median(t) * 1e3} for e, t in times.items()}


def write_ratios(rows, times, length, rounds, out_dir, argv, section="attention-ratios"):
    out_dir = Path(out_dir)
    (out_dir / "bench").mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "length": length, "rounds": rounds, "B": B, "H": H, "D": D, "M": M,
            "command": "python -m favor.bench " + " ".join(argv), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    (out_dir / "bench" / f"{section}.json").write_text(json.dumps({"meta": meta, "rows": rows, "times": times},
                                                                  indent=1))
    met = lambda r: "met" if r["median_ratio"] <= r["target"] else "not met"
    lines = ["| ratio | target | ratio of minima | median of per-round ratios | rounds within | verdict |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['numerator']} : {r['denominator']} | ≤ {r['target']:g} | {r['ratio_of_minima']:.2f} | "
              f"{r['median_ratio']:.2f} | {r['rounds_within_target']:.0%} | {met(r)} |" for r in rows]
    times_lines = ["| program | min ms | median ms |", "|---|---|---|"]
    times_lines += [f"| {e} | {t['min_ms']:.2f} | {t['median_ms']:.2f} |" for e, t in sorted(times.items())]
    flags = f"XLA_FLAGS='{meta['xla_flags']}' " if meta["xla_flags"] else ""
    body = (f"## {section} (`{flags}{meta['command']}`)\n\n"
            f"L = {length}, B = {B}, H = {H}, D = {D}, feature width F = {M} for every kind, float32, "
            f"{meta['backend']} ({meta['cpu_count']} cores), jax {meta['jax']}. Forward passes ('+grad': "
            f"forward and backward) timed round-robin, {rounds} rounds, "
            f"each round every program once in a random order (load falls on all alike); the verdict reads the "
            f"median of the per-round ratios. 'matmul:' is a square matmul scaled to the kind's FLOP count. "
            f"Raw figures: bench/{section}.json.\n\n" + "\n".join(lines) + "\n\n" + "\n".join(times_lines))
    replace_section(out_dir, section, body)


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def table(rows):
    by = {(r["kind"], r["length"], r["causal"]): r for r in rows}
    lines = ["| L | mode | kind | fwd ms | fwd / matmul | fwd / softmax | fwd+bwd ms | fwd+bwd / matmul | "
             "softmax / fwd+bwd | fwd+bwd peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f="{:.2f}": "—" if x is None else f.format(x)
    for r in rows:
        mode = "causal" if r["causal"] else "bidir"
        if "error" in r:
            lines.append(f"| {r['length']} | {mode} | {r['kind']} | {r['error']} |||||||")
            continue
        sm = by.get(("softmax", r["length"], r["causal"]), {})
        f, fb = r["fwd"], r["fwd_bwd"]
        ms = lambda x: None if x is None else x * 1e3
        skip = lambda m, text: "skipped: " + m["skipped"] if "skipped" in m else text
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["length"], mode, r["kind"], skip(f, fmt(ms(f["seconds"]))), fmt(_ratio(f["seconds"], f["matmul_seconds"])),
            fmt(_ratio(f["seconds"], sm.get("fwd", {}).get("seconds"))), skip(fb, fmt(ms(fb["seconds"]))),
            fmt(_ratio(fb["seconds"], fb["matmul_seconds"])),
            fmt(_ratio(sm.get("fwd_bwd", {}).get("seconds"), fb["seconds"]), "{:.1f}"),
            fmt(None if fb["peak_bytes"] is None else fb["peak_bytes"] / 2 ** 20, "{:.0f}")))
    return "\n".join(lines)


def write(rows, out_dir, argv, section="attention-benchmark"):
    out_dir = Path(out_dir)
    (out_dir / "bench").mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": str(jax.devices()),
            "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "malloc_keeps_pages": runtime.keep_host_pages(), "B": B, "H": H, "D": D, "M": M,
            "command": "python -m favor.bench " + " ".join(argv), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    name = "attention" if section == "attention-benchmark" else section
    (out_dir / "bench" / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    flags = f"XLA_FLAGS='{meta['xla_flags']}' " if meta["xla_flags"] else ""
    body = (f"## {section} (`{flags}{meta['command']}`)\n\n"
            f"B = {B}, H = {H}, D = {D}, feature width F = {M} for every kind, float32, {meta['backend']} "
            f"({meta['cpu_count']} cores), jax {meta['jax']}, malloc keeps freed pages: "
            f"{meta['malloc_keeps_pages']} (favor/runtime.py). Ratios are within this one run; "
            f"'matmul' is a square matmul with the kind's own FLOP count. Raw figures: bench/{name}.json.\n\n"
            f"{table(rows)}")
    replace_section(out_dir, section, body)


def parts(length, repeats):
    """FAVOR+'s bidirectional forward and its unavoidable parts, each timed alone in its own shapes as
    XLA:CPU runs them, in units of the forward's same-FLOP square matmul (one run): where the issue 3
    roofline target (1.5×) stands against what the parts cost even if everything between them fused."""
    kind, opts = kind_options("favor+")
    attn = attention.get(kind, **opts)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (0.5 * jax.random.normal(kk, (B, length, H, D)) for kk in ks[:3])
    fwd = lambda q, k, v, rng: attn(q, k, v, rng=rng)
    compiled, _, _ = _compile(fwd, (q, k, v, ks[3]))
    flops = _flops(flop_twin(kind, opts, length, False), False, q, k, v, ks[3], None, grad=False)
    yard = matmul_seconds(flops, repeats)
    n, f32 = B * H * length, jnp.float32
    x = jax.random.normal(ks[0], (n, D + 2), f32)             # [u, ‖u‖², 1]: the library's one-matmul form
    w = jax.random.normal(ks[1], (D + 2, M), f32)
    logits = jax.random.normal(ks[2], (B, H, length, M), f32)
    v1 = jax.random.normal(ks[3], (B, H, length, D + 1), f32)
    vk = jax.random.normal(ks[3], (B, H, D + 1, M), f32)
    rows = [
        ("FAVOR+ forward (the library)", _timed(compiled, (q, k, v, ks[3]), repeats)),
        ("2 projections [B·H·L, D+2] @ [D+2, M]", 2 * _timed(jax.jit(lambda x, w: x @ w), (x, w), repeats)),
        ("2 exp over [B, H, L, M], written", 2 * _timed(jax.jit(jnp.exp), (logits,), repeats)),
        ("2 exp over [B, H, L, M], consumed in place (a fused kernel's cost)",
         2 * _timed(jax.jit(lambda a: jnp.sum(jnp.exp(a), -1)), (logits,), repeats)),
        ("[V,1]ᵀΦ_k contraction", _timed(jax.jit(lambda a, b: jnp.einsum("bhld,bhlf->bhdf", a, b)),
                                          (v1, logits), repeats)),
        ("Φ_q (Φ_kᵀ[V,1]) contraction", _timed(jax.jit(lambda a, b: jnp.einsum("bhlf,bhdf->bhld", a, b)),
                                               (logits, vk), repeats)),
    ]
    t = dict(rows)
    floor = (t["2 projections [B·H·L, D+2] @ [D+2, M]"] + t["[V,1]ᵀΦ_k contraction"]
             + t["Φ_q (Φ_kᵀ[V,1]) contraction"] + t["2 exp over [B, H, L, M], consumed in place (a fused kernel's cost)"])
    rows.append(("sum of the parts with perfect fusion (matmuls + in-place exp)", floor))
    return [{"part": name, "seconds": sec, "ratio": sec / yard} for name, sec in rows], yard, flops


def replace_section(out_dir, section, body):
    begin, end = markers(section)
    body = f"{begin}\n{body}\n{end}"
    md = Path(out_dir) / "BENCHMARKS.md"
    text = md.read_text() if md.exists() else "# Benchmarks\n\nEvery figure is measured by `python -m favor.bench ...`.\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + body + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    md.write_text(text)


def train(config, metric, target, lower_is_better, flags, out_dir, section, argv):
    """One train.py run; the eval metric against wall-clock seconds and the time to reach `target`."""
    import subprocess
    import sys
    import tempfile
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="favor-bench-") as workdir:
        t0 = time.perf_counter()
        code = subprocess.call([sys.executable, str(root / "train.py"), "--config", config, "--workdir", workdir,
                                *flags], cwd=root)
        wall = time.perf_counter() - t0
        if code:
            raise SystemExit(f"train.py exited with {code}")
        summary = json.loads((Path(workdir) / "summary.json").read_text())
    evals = summary.get("eval_history") or []
    if not evals or metric not in evals[0]:
        raise SystemExit(f"metric {metric!r} not in the run's eval metrics {sorted(evals[0]) if evals else []}")
    met = lambda v: v < target if lower_is_better else v > target
    first = next((e for e in evals if met(e[metric])), None)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "command": "python -m favor.bench " + " ".join(argv),
            "process_seconds": wall, "target": target, "metric": metric, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "seconds_to_target": first["seconds"] if first else None}
    (Path(out_dir) / "bench").mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "bench" / f"{section}.json").write_text(json.dumps({"meta": meta, "evals": evals}, indent=1))
    keys = [k for k in evals[0] if k not in ("step", "seconds")]
    rows = ["| step | seconds | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    rows += [f"| {e['step']} | {e['seconds']:.0f} | " + " | ".join(f"{e[k]:.4f}" for k in keys) + " |" for e in evals]
    verdict = (f"{metric} {'<' if lower_is_better else '>'} {target} first at step {first['step']}, "
               f"{first['seconds']:.0f} s after the run started" if first else f"{metric} never reached {target}")
    flags = f"XLA_FLAGS='{meta['xla_flags']}' " if meta["xla_flags"] else ""
    body = (f"## {section} (`{flags}{meta['command']}`)\n\n"
            f"{meta['backend']} ({meta['cpu_count']} cores), jax {meta['jax']}; seconds count from the start of "
            f"`trainer.run` (data preparation, compilation and evaluation included); the whole process took "
            f"{wall:.0f} s. {verdict}. Raw figures: bench/{section}.json.\n\n" + "\n".join(rows))
    replace_section(out_dir, section, body)
    print(verdict)
    return meta


# -- steps: a config's training step for several kinds, timed round-robin ------------------------------
STEP_KINDS = ("softmax", "relu", "elu", "favor", "favor+", "favor++", "favor#", "hrf", "simrf")


def train_steps(config_spec, kinds, rounds, seed=0, flags=()):
    """Seconds per training step of `config_spec` (configs/<file>.py[:args], with `flags` as
    --config.key=value overrides) for each attention kind: every kind's jitted step (data, model, shardings
    and optimizer as train.py builds them, one fixed batch) run once per round in a fresh random order, so
    load on a shared machine falls on all alike. Returns {kind: [seconds per round]}."""
    from favor import configlib, sharding, trainer
    programs = {}
    for kind in kinds:
        config = configlib.load(config_spec)
        for flag in flags:
            configlib.apply_flag(config, flag)
        with config.unlocked():
            config.model.attention.kind = kind
        configlib.validate(config)
        source, task = trainer.make_data(config)
        model = trainer.make_model(config, source)
        layout = trainer.make_layout(model, sharding.make_mesh(config.mesh), config.sharding_rules, source)
        step_fn = trainer.make_train_step(config, model, task, layout)
        state = jax.jit(model.init, out_shardings=layout.state)()
        batch = layout.global_batch(next(iter(source.train_batches(int(config.batch_size), 0, int(config.seed)))))
        state, _ = step_fn(state, batch)                                   # compile and warm
        jax.block_until_ready(state)
        programs[kind] = [step_fn, state, batch]
    times = {kind: [] for kind in kinds}
    order, rnd = list(kinds), random.Random(seed)
    for _ in range(rounds):
        rnd.shuffle(order)
        for kind in order:
            step_fn, state, batch = programs[kind]
            t0 = time.perf_counter()
            state, metrics = step_fn(state, batch)
            jax.block_until_ready((state, metrics))
            times[kind].append(time.perf_counter() - t0)
            programs[kind][1] = state
    return times


def write_steps(times, config_spec, rounds, out_dir, argv, reference="favor+", target=2.0, section="train-steps"):
    """The per-kind step times against `reference`'s (median of per-round ratios, ≤ `target` met)."""
    out_dir = Path(out_dir)
    (out_dir / "bench").mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
            "config": config_spec, "rounds": rounds, "command": "python -m favor.bench " + " ".join(argv),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    rows = []
    for kind, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, times[reference])) if reference in times else None
        rows.append({"kind": kind, "min_ms": min(t) * 1e3, "median_ms": statistics.median(t) * 1e3,
                     "steps_per_second": 1.0 / statistics.median(t), "ratio": ratio})
    (out_dir / "bench" / f"{section}.json").write_text(json.dumps({"meta": meta, "rows": rows, "times": times},
                                                                  indent=1))
    verdict = lambda r: "—" if r["ratio"] is None or r["kind"] in ("softmax", "relu", "elu") else (
        "met" if r["ratio"] <= target else "not met")
    lines = [f"| kind | ms per step (min / median) | steps/s | time / {reference}'s | ≤ {target:g}× |",
             "|---|---|---|---|---|"]
    fmt = lambda x: "—" if x is None else f"{x:.2f}"
    lines += [f"| {r['kind']} | {r['min_ms']:.1f} / {r['median_ms']:.1f} | {r['steps_per_second']:.1f} | "
              f"{fmt(r['ratio'])} | {verdict(r)} |" for r in rows]
    flags = f"XLA_FLAGS='{meta['xla_flags']}' " if meta["xla_flags"] else ""
    body = (f"## {section} (`{flags}{meta['command']}`)\n\n"
            f"`{config_spec}`'s training step (forward, backward, optimizer; the config's batch) for each kind, "
            f"{meta['backend']} ({meta['cpu_count']} cores), jax {meta['jax']}: every kind's step once per round "
            f"in a random order, {rounds} rounds; the ratio is the median of the per-round ratios to "
            f"{reference}'s step. Raw figures: bench/{section}.json.\n\n" + "\n".join(lines))
    replace_section(out_dir, section, body)
    return rows


def _ints(parser, flag, text):
    """A comma-separated list of positive integers, or the parser's error naming the flag and the value."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"{flag} {text!r}: expected positive integers separated by commas")
    return values


def main(argv=None):
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv_main = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m favor.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    pp = sub.add_parser("parts", help="FAVOR+'s forward against the cost of its parts (the roofline target)")
    pp.add_argument("--length", type=int, default=8192)
    pp.add_argument("--repeats", type=int, default=5)
    pp.add_argument("--out", default=".")
    t = sub.add_parser("train", help="a train.py run: eval metric against wall-clock time (flags after --)")
    t.add_argument("--config", required=True, help="configs/<file>.py[:args]")
    t.add_argument("--metric", required=True, help="an eval metric of the config's task (e.g. wer, accuracy)")
    t.add_argument("--target", type=float, required=True)
    t.add_argument("--higher_is_better", action="store_true", help="default: lower is better (error rates)")
    t.add_argument("--out", default=".")
    t.add_argument("--section", default="train-benchmark")
    p = sub.add_parser("attention", help="every attention kind, bidirectional and causal")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--kinds", default=",".join(attention.names() + ("favor#:saderf",)))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=".")
    p.add_argument("--section", default="attention-benchmark",
                   help="BENCHMARKS.md section (and bench/<section>.json) this run replaces")
    r = sub.add_parser("ratios", help="speed ratios against targets, every program timed round-robin")
    r.add_argument("--length", type=int, default=8192)
    r.add_argument("--rounds", type=int, default=15)
    r.add_argument("--targets", default="long",
                   help="a named set (long: the long-sequence speed targets; kinds: the kinds' costs at one "
                        "width) or NUMERATOR,DENOMINATOR,TARGET;... with entries kind/bidir, kind/causal, "
                        "either +grad (forward and backward), or matmul:kind/mode (default: %(default)s)")
    r.add_argument("--out", default=".")
    r.add_argument("--section", default="attention-ratios")
    st = sub.add_parser("steps", help="a config's training step for every kind, timed round-robin (flags after --)")
    st.add_argument("--config", default="configs/default.py", help="configs/<file>.py[:args] (default: %(default)s)")
    st.add_argument("--kinds", default=",".join(STEP_KINDS))
    st.add_argument("--rounds", type=int, default=30)
    st.add_argument("--out", default=".")
    st.add_argument("--section", default="train-steps")
    pe = sub.add_parser("peers", help="favor's FAVOR+ against performer-pytorch, round-robin (the bench extra)")
    pe.add_argument("--lengths", default=",".join(map(str, bench_peers.LENGTHS)))
    pe.add_argument("--modes", default=",".join(bench_peers.MODES))
    pe.add_argument("--rounds", type=int, default=15)
    pe.add_argument("--out", default=".")
    pe.add_argument("--section", default="peers")
    from favor import bench_uptrain
    bench_uptrain.add_parser(sub)
    args = parser.parse_args(argv_main)
    if args.what == "peers":
        lengths = _ints(parser, "--lengths", args.lengths)
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in bench_peers.MODES]
        if bad or not modes:
            parser.error(f"--modes: unknown {', '.join(bad) or '(none given)'}; valid: {', '.join(bench_peers.MODES)}")
        if args.rounds < 1:
            parser.error(f"--rounds {args.rounds}: must be at least 1")
        runtime.keep_host_pages()
        times = bench_peers.peers(lengths, modes, args.rounds)
        table = bench_peers.rows(times)
        meta = bench_peers.meta(args.rounds, "python -m favor.bench " + " ".join(argv))
        replace_section(args.out, args.section, bench_peers.markdown(table, meta, args.section))
        (Path(args.out) / "bench").mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench" / f"{args.section}.json").write_text(json.dumps(
            {"meta": meta, "rows": table, "times": {"/".join(map(str, k)): v for k, v in times.items()}}, indent=1))
        for r in table:
            print(f"L={r['length']:>5} {r['mode']:>13} {r['pass']:>7}: favor {r['favor_ms']:8.2f} ms, "
                  f"peer {r['peer_ms']:8.2f} ms, favor/peer {r['median_ratio']:.2f}")
        return
    if args.what == "uptrain":
        bench_uptrain.main(args, flags, argv)
        return
    if args.what == "parts":
        runtime.keep_host_pages()
        rows, yard, flops = parts(args.length, args.repeats)
        table_rows = "\n".join(f"| {r['part']} | {r['seconds'] * 1e3:.2f} | {r['ratio']:.2f} |" for r in rows)
        body = (f"## favor-plus-parts (`python -m favor.bench {' '.join(argv)}`)\n\n"
                f"L = {args.length}, B = {B}, H = {H}, D = {D}, M = {M}, float32, {jax.default_backend()} "
                f"({os.cpu_count()} cores), jax {jax.__version__}. Each part timed alone (median of "
                f"{args.repeats}); ratios to a square matmul of the forward's {flops / 1e9:.2f} GFLOP "
                f"({yard * 1e3:.2f} ms), all in this one run.\n\n| part | ms | / matmul |\n|---|---|---|\n"
                f"{table_rows}")
        replace_section(args.out, "favor-plus-parts", body)
        (Path(args.out) / "bench").mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench" / "favor-plus-parts.json").write_text(json.dumps(
            {"length": args.length, "matmul_seconds": yard, "flops": flops, "rows": rows}, indent=1))
        print(table_rows)
        return
    if args.what == "ratios":
        targets = TARGET_SETS.get(args.targets)
        if targets is None:
            try:
                targets = []
                for item in args.targets.split(";"):
                    fields = [x.strip() for x in item.split(",")]   # not `parts`: main calls parts()
                    if len(fields) != 3:
                        raise ValueError(f"target {item!r}: expected NUMERATOR,DENOMINATOR,TARGET")
                    _entry(fields[0]), _entry(fields[1])
                    targets.append((fields[0], fields[1], float(fields[2])))
            except ValueError as e:
                parser.error(str(e))
        runtime.keep_host_pages()
        rows, times = ratios(targets, args.length, args.rounds)
        write_ratios(rows, times, args.length, args.rounds, args.out, argv, args.section)
        for row in rows:
            print(f"{row['numerator']:>20} : {row['denominator']:<20} {row['median_ratio']:.2f} "
                  f"(min {row['ratio_of_minima']:.2f}, target {row['target']:g})")
        return
    if args.what == "train":
        train(args.config, args.metric, args.target, not args.higher_is_better, flags, args.out, args.section, argv)
        return
    if args.what == "steps":
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in attention.names()]
        if unknown:
            parser.error(f"--kinds: unknown {', '.join(unknown)}; valid: {', '.join(attention.names())}")
        times = train_steps(args.config, kinds, args.rounds, flags=flags)
        for r in write_steps(times, args.config, args.rounds, args.out, argv, section=args.section):
            print(f"{r['kind']:>8}: {r['median_ms']:7.1f} ms/step" +
                  ("" if r["ratio"] is None else f", {r['ratio']:.2f}× favor+"))
        return
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in kinds:
        if k.partition("@")[0].partition(":")[0] not in attention.names():
            parser.error(f"unknown kind {k!r}; valid: {', '.join(attention.names())} (optionally kind:variant, "
                         f"kind@window)")
    lengths = _ints(parser, "--lengths", args.lengths)
    runtime.keep_host_pages()   # for every kind and the yardsticks alike; see favor/runtime.py
    run(kinds, lengths, args.repeats, args.out, lambda rows: write(rows, args.out, argv, args.section))
    print(f"wrote {Path(args.out) / 'BENCHMARKS.md'} and {Path(args.out) / 'bench' / 'attention.json'}")


if __name__ == "__main__":
    main()
