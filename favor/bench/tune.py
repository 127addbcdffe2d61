"""`python -m favor.bench tune`: how the fused kernels should cut and launch a call on this device
(favor.attention.fused.TUNING: tokens per chunk, features per block, warps per program, pipelining stages,
per mode and product precision). The kernels alone, forward+backward (FAVOR+'s log-linear maps: no draw,
no feature-map glue, no fallback), for each candidate cut, every candidate of one mode, precision and
length timed round-robin in one run, each as a ratio to the cut TUNING holds now. The section names the
fastest candidate per mode, precision and length beside TUNING's entry: TUNING is edited by hand from it.

On a CPU the kernels run in Pallas interpret mode, an emulator: the command runs (the tests use it), but
its times say nothing of a GPU.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from favor import runtime
from favor.attention import fused
from favor.bench import sections
from favor.bench.accel import error_text, ready
from favor.bench.common import choices, ints, round_robin

# (chunk, feature block, warps, stages): the grid the TUNING table was chosen from, around its entries
CANDIDATES = ((64, 64, 4, 1), (32, 64, 4, 1), (16, 64, 4, 1), (32, 32, 4, 1), (16, 32, 4, 1), (64, 64, 4, 2),
              (32, 64, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (128, 64, 4, 1), (64, 64, 8, 1), (64, 128, 4, 1))
MODES = {"causal": True, "bidir": False}


def parse_cut(text):
    """'32x64x4x2' -> (32, 64, 4, 2); chunk and block powers of two from 16 (Triton's smallest product
    tiles), warps 1, 2, 4 or 8, stages ≥ 1."""
    try:
        cut = tuple(int(x) for x in text.split("x"))
    except ValueError:
        cut = ()
    ok = (len(cut) == 4 and all(n >= 16 and n & (n - 1) == 0 for n in cut[:2]) and cut[2] in (1, 2, 4, 8)
          and cut[3] >= 1)
    if not ok:
        raise ValueError(f"a cut is chunk x block x warps x stages, chunk and block powers of two from 16, warps "
                         f"1/2/4/8, stages ≥ 1 (e.g. 32x64x4x2); got {text!r}")
    return cut


def _inputs(length, batch, heads, d, f, seed=0):
    """FAVOR+'s log-linear maps of random bf16 queries and keys (scaled by D^(-1/4)), bf16 values."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x, y = (0.5 * jax.random.normal(k, (batch, heads, length, d)) * d ** -0.25 for k in ks[:2])
    v = jax.random.normal(ks[2], (batch, heads, length, d)).astype(jnp.bfloat16)
    p = jax.random.normal(ks[3], (heads, d, f))
    c = jnp.full((heads, f), -0.5 * jnp.log(f))
    row = lambda a: -0.5 * jnp.sum(a * a, -1)
    return x.astype(jnp.bfloat16), row(x), y.astype(jnp.bfloat16), row(y), v, p, c


def _lowered(causal, precision, cut, inputs):
    """The kernels' forward+backward cut and launched as `cut` (chunk, feature block, warps, stages), lowered."""
    def loss(xq, rq, xk, rk, v, p, c):
        return jnp.sum(fused.attend(xq, rq, p, c, xk, rk, p, c, v, None, causal, precision=precision, cut=cut)[0])
    return jax.jit(jax.grad(loss, (0, 1, 2, 3, 4))).lower(*inputs)


def measure(causal, precision, length, batch, cuts, rounds, shape, seed=0):
    """{cut: {"median_ms", "ratio"} or {"error"}} of one mode, precision and length, round-robin; the
    ratio is to the cut TUNING holds now (measured too, whether or not `cuts` names it)."""
    current = fused.tuning(causal, precision)
    cuts = list(dict.fromkeys([current, *cuts]))
    inputs = _inputs(length, batch, *shape, seed=seed)
    lowered, results = {}, {}
    for cut in cuts:
        try:
            lowered[cut] = _lowered(causal, precision, cut, inputs)
        except Exception as e:                                     # noqa: BLE001 — reported, not hidden
            results[cut] = {"error": error_text(e)}
    programs, failed = ready(lowered, inputs)
    results.update({cut: {"error": why} for cut, why in failed.items()})
    times = round_robin({cut: (p, inputs, 1.0) for cut, p in programs.items()}, rounds, seed, warm=False)
    for cut, t in times.items():
        results[cut] = {"median_ms": statistics.median(t) * 1e3}
        if current in times:
            results[cut]["ratio"] = statistics.median(a / b for a, b in zip(t, times[current]))
    return {cut: results[cut] for cut in cuts}


def _name(cut):
    return "x".join(map(str, cut))


def add_parser(sub):
    p = sub.add_parser("tune", help="the fused kernels' cut and launch (fused.TUNING) measured on this device")
    p.add_argument("--modes", default="causal,bidir")
    p.add_argument("--precisions", default="tf32x3,bf16", help="kernel product precisions (fused.PRECISIONS)")
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens / L, at least 1")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--cuts", default=",".join(map(_name, CANDIDATES)),
                   help="candidates, chunk x block x warps x stages (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--budget", type=float, default=3000.0,
                   help="seconds: configurations (mode, precision, length) started after it are not run")
    p.add_argument("--quick", action="store_true", help="CPU-sized: L = 64, 2 heads, F = 32, two cuts, 2 rounds")
    p.add_argument("--out", default=None,
                   help="where BENCHMARKS.md and bench/ are (default: '.', the committed figures from the checkout's "
                        "root; with --quick a new temporary directory, so a smoke run never replaces them)")
    p.add_argument("--section-suffix", default="", help="appended to the section's name")


def main(args, flags, argv, parser):
    modes = [MODES[m] for m in choices(parser, "--modes", args.modes, tuple(MODES))]
    precisions = choices(parser, "--precisions", args.precisions, tuple(fused.PRECISIONS))
    lengths = ints(parser, "--lengths", args.lengths)
    try:
        cuts = [parse_cut(t) for t in args.cuts.split(",")]
    except ValueError as e:
        parser.error(f"--cuts: {e}")
    shape, rounds, tokens = (args.heads, args.head_dim, args.features), args.rounds, args.tokens
    if args.quick:
        lengths, shape, rounds, tokens, cuts = [64], (2, 16, 32), 2, 64, [(16, 32, 4, 1)]
    runtime.keep_host_pages()
    device = "".join(c if c.isalnum() else "-" for c in jax.devices()[0].device_kind.lower())
    section = ("tune-cpu" if jax.default_backend() == "cpu" else f"tune-{device}") + args.section_suffix
    meta = sections.machine(argv, tokens=tokens, rounds=rounds, heads=shape[0], head_dim=shape[1], features=shape[2],
                            quick=args.quick)
    out = sections.resolve_out(args.out, "tune", args.quick)
    names = list(dict.fromkeys(_name(c) for c in ([fused.tuning(m, p) for m in modes for p in precisions] + cuts)))
    rows, start = [], time.perf_counter()
    for causal in modes:
        for precision in precisions:
            for length in lengths:
                batch = max(1, tokens // length)
                row = {"causal": causal, "precision": precision, "length": length, "batch": batch,
                       "tuning": _name(fused.tuning(causal, precision))}
                if time.perf_counter() - start > args.budget:
                    rows.append({**row, "results": {}, "note": "not run: the time budget was spent"})
                else:
                    results = measure(causal, precision, length, batch, cuts, rounds, shape)
                    rows.append({**row, "results": {_name(c): r for c, r in results.items()}})
                    print(f"{'causal' if causal else 'bidir'} {precision} L={length} B={batch}: " + ", ".join(
                        f"{n} " + (f"{r['median_ms']:.2f}ms" if "median_ms" in r else r["error"])
                        for n, r in rows[-1]["results"].items()), flush=True)
                # after every configuration: a run ended from outside (a device's loan, `timeout`) keeps
                # what it measured
                sections.publish(out, section, _text(section, meta, rows, names), {"meta": meta, "rows": rows})
    if args.out is None and args.quick:
        sections.said_quick(out, section)


def _text(section, meta, rows, cuts):
    def cell(r, best):
        if "median_ms" not in r:
            return f"— ({r['error']})"
        text = f"{r['median_ms']:.2f}" + (f" ({r['ratio']:.2f}×)" if "ratio" in r else "")
        return f"**{text}**" if best else text
    lines = ["| mode | precision | L | B | TUNING | fastest | " + " | ".join(cuts) + " |", "|---" * (6 + len(cuts)) + "|"]
    for row in rows:
        timed = {n: r for n, r in row["results"].items() if "median_ms" in r}
        best = min(timed, key=lambda n: timed[n]["median_ms"]) if timed else None
        mode = "causal" if row["causal"] else "bidirectional"
        if "note" in row:
            lines.append(f"| {mode} | {row['precision']} | {row['length']} | {row['batch']} | {row['tuning']} | "
                         f"— | {row['note']} |" + " |" * (len(cuts) - 1))
            continue
        lines.append(f"| {mode} | {row['precision']} | {row['length']} | {row['batch']} | {row['tuning']} | "
                     f"{best or '—'} | " + " | ".join(cell(row["results"][n], n == best) if n in row["results"]
                                                      else "" for n in cuts) + " |")
    emulated = (" On a CPU the kernels run in Pallas interpret mode, an emulator: these times say nothing of a "
                "GPU." if meta["backend"] == "cpu" else "")
    return (f"{sections.heading(section, meta)}\n\n{sections.where(meta)}. The fused kernels alone (FAVOR+'s "
            f"log-linear maps, {meta['heads']} heads, head dim {meta['head_dim']}, F = {meta['features']}, bf16 "
            f"inputs; forward+backward; B = {meta['tokens']} / L, at least 1) for each cut, chunk x feature block x "
            f"warps x pipelining stages; each cell the median milliseconds of {meta['rounds']} round-robin rounds and, in "
            f"parentheses, the median ratio to the cut favor.attention.fused.TUNING holds now; the fastest in "
            f"bold.{emulated} Raw figures: bench/{section}.json.\n\n" + "\n".join(lines))
