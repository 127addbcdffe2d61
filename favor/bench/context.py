"""`python -m favor.bench context [--lengths 65536,...] [--devices 1,2,4,8]`: long context over the sequence
mesh axis (favor.attention.sequence), FAVOR+ against softmax.

One causal attention layer (projections in and out, `--heads` × `--head-dim`, FAVOR+ with `--features`),
forward and backward, at each row length L over n devices of the axis. Per program, from XLA and not
timed: the per-device planned peak memory (the compiled program's memory analysis: arguments, outputs and
temporaries) and the bytes per device that pass through collectives (the results of every all-gather,
all-reduce, reduce-scatter, all-to-all and collective-permute in the compiled HLO); and the wall time of
the FAVOR+ programs whose memory fits the machine (softmax's too where it fits). On CPU the devices are
simulated (XLA_FLAGS=--xla_force_host_platform_device_count, set by re-running itself), so the times are
those of one host's cores shared by n devices: they show that a length runs, not a speed-up.

Writes BENCHMARKS.md section `context-parallel`, bench/context-parallel.json and bench/context-parallel.png.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from favor import attention
from favor.attention import sequence
from favor.bench import sections
from favor.bench.common import ints, memory_budget, peak_bytes

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_SHAPE = re.compile(r"(f64|f32|bf16|f16|s32|u32|s8|u8|pred)\[([\d,]*)\]")
_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
KINDS = ("favor+", "softmax")


def add_parser(sub):
    p = sub.add_parser("context", help="long context over the sequence mesh axis: memory, collectives, time")
    p.add_argument("--lengths", default="65536,131072,262144,524288,1048576", help="row lengths L")
    p.add_argument("--devices", default="1,2,4,8", help="sizes of the sequence axis")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--features", type=int, default=64, help="FAVOR+'s random features per head")
    p.add_argument("--time-devices", type=int, default=8, help="the axis size whose programs are timed")
    p.add_argument("--quick", action="store_true", help="short lengths (a smoke run)")
    p.add_argument("--out", default=None, help="where BENCHMARKS.md and bench/ are written (default: the "
                                              "checkout; --quick: a temporary directory)")


_OP = re.compile(r"=\s*(\([^)]*\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def collective_bytes(hlo: str) -> int:
    """Bytes per device of the results of every collective in a compiled program's HLO text (an async
    start's result only: the last shape of its tuple)."""
    total = 0
    for m in _OP.finditer(hlo):
        shapes = _SHAPE.findall(m.group(1))
        for dtype, dims in (shapes[-1:] if m.group(3) else shapes):
            total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _layer(kind, heads, dim, features):
    """(loss(params, x), params): a causal attention layer's projections and attention, summed to a scalar."""
    attn = attention.get(kind) if kind == "softmax" else attention.get(kind, num_features=features)
    hidden = heads * dim
    keys = jax.random.split(jax.random.key(0), 4)
    params = {n: jax.random.normal(k, (hidden, hidden), jnp.float32) / np.sqrt(hidden)
              for n, k in zip(("q", "k", "v", "o"), keys)}

    def loss(params, x):
        b, l, _ = x.shape
        x = sequence.constrain(x)
        split = lambda w: (x @ w).reshape(b, l, heads, dim)
        out = attn(split(params["q"]), split(params["k"]), split(params["v"]), causal=True, rng=jax.random.key(1))
        return jnp.sum(sequence.constrain(out.reshape(b, l, hidden) @ params["o"]) ** 2) / l
    return loss, params


def measure(kind, length, n, args, run):
    """{peak, collective, seconds} of the layer's forward and backward at `length` over n devices."""
    loss, params = _layer(kind, args.heads, args.head_dim, args.features)
    mesh = jax.make_mesh((n,), ("sequence",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.ShapeDtypeStruct((1, length, args.heads * args.head_dim), jnp.float32)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    with sequence.over(mesh):
        compiled = step.lower(params, x).compile()
    row = {"kind": kind, "length": length, "devices": n, "peak": peak_bytes(compiled),
           "collective": collective_bytes(compiled.as_text()), "seconds": None}
    if run and row["peak"] is not None and row["peak"] * n < memory_budget():
        xs = jax.random.normal(jax.random.key(2), x.shape, x.dtype)
        jax.block_until_ready(compiled(params, xs))                      # warm
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, xs))
        row["seconds"] = time.perf_counter() - t0
    return row


def _reexec(needed):
    """Re-run this command with `needed` simulated CPU devices (the flag must be set before JAX starts)."""
    flag = f"--xla_force_host_platform_device_count={needed}"
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip(), JAX_PLATFORMS="cpu")
    os.execve(sys.executable, [sys.executable, "-m", "favor.bench", *sys.argv[1:]], env)


def main(args, flags, argv, parser):
    lengths = ints(parser, "--lengths", "2048,4096,8192" if args.quick else args.lengths)
    devices = ints(parser, "--devices", args.devices)
    if max(devices) > jax.device_count():
        if jax.default_backend() != "cpu":
            parser.error(f"--devices up to {max(devices)} needs that many accelerators; this machine has "
                         f"{jax.device_count()}")
        _reexec(max(devices))
    out = sections.resolve_out(args.out, "context-parallel", args.quick)
    rows = []
    for length in lengths:
        for n in devices:
            for kind in KINDS:
                if length % n:
                    continue
                run = n == args.time_devices and (kind == "favor+" or length <= 8192)
                rows.append(measure(kind, length, n, args, run))
                r = rows[-1]
                print(f"{kind:8s} L={length:8d} n={n}: peak {r['peak'] / 2 ** 20:10.1f} MiB, collectives "
                      f"{r['collective'] / 2 ** 10:12.1f} KiB" + (f", {r['seconds']:.2f} s" if r["seconds"] else ""),
                      flush=True)
    meta = sections.machine(argv, quick=bool(args.quick), heads=args.heads, head_dim=args.head_dim,
                            features=args.features)
    body = report(rows, lengths, devices, meta, args)
    plot(rows, devices, Path(out) / "bench" / "context-parallel.png")
    sections.publish(out, "context-parallel", body, {"meta": meta, "rows": rows})
    if args.quick and args.out is None:
        sections.said_quick(out, "context-parallel")


def _at(rows, kind, length, n):
    return next((r for r in rows if r["kind"] == kind and r["length"] == length and r["devices"] == n), None)


def report(rows, lengths, devices, meta, args):
    mib = lambda b: "—" if b is None else f"{b / 2 ** 20:,.0f}"
    kib = lambda b: "—" if b is None else f"{b / 2 ** 10:,.0f}"
    lines = [sections.heading("context-parallel", meta), "",
             f"One causal attention layer ({args.heads} heads of {args.head_dim}, projections in and out; FAVOR+ "
             f"with {args.features} features), forward and backward, its row split over n devices of the "
             f"`sequence` mesh axis, on {sections.where(meta)}. Per device, from XLA: planned peak memory "
             "(MiB) and the bytes its collectives return (KiB); not timed. Raw figures: "
             "bench/context-parallel.json; plot: bench/context-parallel.png.", "",
             "| L | " + " | ".join(f"FAVOR+ n = {n}: MiB / KiB" for n in devices)
             + " | " + " | ".join(f"softmax n = {n}: MiB / KiB" for n in devices) + " |",
             "|---|" + "---|" * 2 * len(devices)]
    for length in lengths:
        cells = []
        for kind in KINDS:
            for n in devices:
                r = _at(rows, kind, length, n)
                cells.append("—" if r is None else f"{mib(r['peak'])} / {kib(r['collective'])}")
        lines.append(f"| {length:,} | " + " | ".join(cells) + " |")
    # the goals: memory linear in L/n, communication constant in L and a small part of softmax's
    n_max, l_min, l_max = max(devices), min(lengths), max(lengths)
    fp = [r for r in rows if r["kind"] == "favor+" and r["peak"]]
    base = min(fp, key=lambda r: r["length"] / r["devices"])
    per_token = base["peak"] / (base["length"] / base["devices"])
    worst = max(r["peak"] / (per_token * r["length"] / r["devices"]) for r in fp)
    comm = [r["collective"] for r in fp if r["devices"] == n_max]
    f_top, s_top = _at(rows, "favor+", l_max, n_max), _at(rows, "softmax", l_max, n_max)
    share = f_top["collective"] / s_top["collective"] if f_top and s_top and s_top["collective"] else None
    timed = [r for r in rows if r["seconds"]]
    lines += ["", f"- Per-device memory against linear in L/n (FAVOR+, from its smallest L/n): at most "
                  f"{worst:.2f}× (goal ≤ 1.2×).",
              f"- FAVOR+'s collectives at n = {n_max}: {min(comm) / 2 ** 10:,.0f}–{max(comm) / 2 ** 10:,.0f} KiB "
              f"over L = {l_min:,}–{l_max:,} (constant in L: the states, not the keys)"
              + (f"; {share:.3%} of softmax's at L = {l_max:,} (goal ≤ 1 %)." if share is not None else "."),
              "- Wall time (forward and backward, the n devices simulated on this host's cores, so a "
              "feasibility figure, not a speed-up): "
              + ("; ".join(f"{r['kind']} L = {r['length']:,} over {r['devices']}: {r['seconds']:.1f} s" for r in timed)
                 or "none timed") + "."]
    return "\n".join(lines)


def plot(rows, devices, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(devices):
        for kind, style in (("favor+", "-"), ("softmax", "--")):
            pts = sorted((r["length"], r) for r in rows if r["kind"] == kind and r["devices"] == n)
            if not pts:
                continue
            ls = [l for l, _ in pts]
            axes[0].plot(ls, [r["peak"] / 2 ** 20 for _, r in pts], style, marker="o", color=colors[i % len(colors)],
                         label=f"{kind}, n = {n}")
            if n > 1:
                axes[1].plot(ls, [max(r["collective"], 1) / 2 ** 10 for _, r in pts], style, marker="o",
                             color=colors[i % len(colors)], label=f"{kind}, n = {n}")
    for ax, title, unit in ((axes[0], "Per-device peak memory", "MiB"),
                            (axes[1], "Per-device bytes through collectives", "KiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("row length L (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].legend(fontsize=7)
    fig.suptitle("One causal attention layer, forward + backward, its sequence split over n devices "
                 "(solid: FAVOR+, dashed: softmax)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
