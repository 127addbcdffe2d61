"""`python -m favor.bench peers`: favor's FAVOR+ against the public Performer in one round-robin harness.

The peer is performer-pytorch's `FastAttention` (PyPI; the optional `bench` extra, never a dependency of
the library), FAVOR+ with its own projection matrix, on torch CPU with as many threads as cores. favor runs
FAVOR+ with a fixed draw (made once, as the peer keeps its matrix), jitted. Both get the same inputs
(B = 1, H = 4, D = 64, M = 256, q, k, v ~ N(0, 0.25)); each (length, mode, pass) is one program per
implementation, and every round runs every program in a fresh random order, so load on a shared
machine falls on all alike. A program's turn is one untimed call, then BURST timed calls (their mean):
torch's OpenMP threads spin for a while after a call returns, and timing a JAX program's first call after
torch's measures that spin on two cores (favor and a plain JAX FAVOR+ alike ran 1.2–1.4× slower by the
median that way at L = 256–512); a training step runs its attention calls back to back. Figures: the minimum
over rounds, and the median of per-round ratios.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from importlib.metadata import version

import jax
import jax.numpy as jnp
import numpy as np

from favor import attention, runtime
from favor.bench import sections
from favor.bench.common import B, D, H, M, ints
LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
MODES = ("bidirectional", "causal")
BURST = 3               # timed calls per turn, after one untimed call


def _torch():
    try:
        # optional (the bench extra): only this subcommand needs them
        import torch
        from performer_pytorch import FastAttention
    except ImportError as e:
        raise SystemExit(f"bench peers needs performer-pytorch and torch ({e}); "
                         "install them with: pip install -e '.[bench]'") from None
    return torch, FastAttention


def meta(rounds, argv):
    """What a figure of this harness depends on: versions, threads, cores, rounds, the command."""
    torch, _ = _torch()
    return sections.machine(argv, torch=torch.__version__, torch_threads=torch.get_num_threads(),
                            peer_version=version("performer-pytorch"), rounds=rounds, burst=BURST)


def inputs(length, seed=0):
    """q, k, v [B, L, H, D] float32 ~ N(0, 0.25), as numpy (each side makes its own arrays from them)."""
    rng = np.random.default_rng(seed)
    return tuple(0.5 * rng.standard_normal((B, length, H, D)).astype(np.float32) for _ in range(3))


def favor_programs(length, causal, qkv):
    """(forward, forward+backward) of favor's FAVOR+, compiled, with their arguments."""
    attn = attention.get("favor+", num_features=M, redraw="fixed")
    args = tuple(jnp.asarray(a) for a in qkv)
    fwd = jax.jit(lambda q, k, v: attn(q, k, v, causal=causal))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v, causal=causal)), argnums=(0, 1, 2)))
    return (lambda: jax.block_until_ready(fwd(*args))), (lambda: jax.block_until_ready(grad(*args)))


def peer_programs(length, causal, qkv):
    """(forward, forward+backward) of performer-pytorch's FastAttention on the same inputs."""
    torch, FastAttention = _torch()
    torch.manual_seed(0)
    attn = FastAttention(dim_heads=D, nb_features=M, causal=causal)
    q, k, v = (torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3))) for a in qkv)   # [B, H, L, D]

    def fwd():
        with torch.no_grad():
            return attn(q, k, v)

    def grad():
        args = [a.clone().requires_grad_(True) for a in (q, k, v)]
        attn(*args).sum().backward()
        return [a.grad for a in args]
    return fwd, grad


def peers(lengths, modes, rounds, seed=0):
    """{(length, mode, pass, side): [seconds per round]} for side in ("favor", "peer"), pass in
    ("fwd", "fwd+bwd"): every program once per round, in a fresh random order each round."""
    torch, _ = _torch()
    torch.set_num_threads(os.cpu_count() or 1)
    programs = {}
    for length in lengths:
        qkv = inputs(length, seed)
        for mode in modes:
            causal = mode == "causal"
            for side, make in (("favor", favor_programs), ("peer", peer_programs)):
                fwd, grad = make(length, causal, qkv)
                programs[(length, mode, "fwd", side)] = fwd
                programs[(length, mode, "fwd+bwd", side)] = grad
    for fn in programs.values():          # compile and warm
        fn()
        fn()
    times = {key: [] for key in programs}
    order, rnd = list(programs), random.Random(seed)
    for _ in range(rounds):
        rnd.shuffle(order)
        for key in order:
            programs[key]()
            t0 = time.perf_counter()
            for _ in range(BURST):
                programs[key]()
            times[key].append((time.perf_counter() - t0) / BURST)
    return times


def rows(times):
    """One row per (length, mode, pass): the minima in ms and favor's time over the peer's."""
    out = []
    for length, mode, pas in dict.fromkeys(key[:3] for key in times):
        f, p = times[(length, mode, pas, "favor")], times[(length, mode, pas, "peer")]
        out.append({"length": length, "mode": mode, "pass": pas, "favor_ms": min(f) * 1e3, "peer_ms": min(p) * 1e3,
                    "ratio_of_minima": min(f) / min(p),
                    "median_ratio": statistics.median(a / b for a, b in zip(f, p))})
    return out


def markdown(table, meta, section):
    """The BENCHMARKS.md section: one line per length and mode, fwd and fwd+bwd side by side."""
    lines = ["| L | mode | favor fwd (ms) | peer fwd (ms) | favor / peer | favor fwd+bwd (ms) | peer fwd+bwd (ms) | "
             "favor / peer |", "|---|---|---|---|---|---|---|---|"]
    by = {(r["length"], r["mode"], r["pass"]): r for r in table}
    for length, mode in dict.fromkeys((r["length"], r["mode"]) for r in table):
        f, g = by[(length, mode, "fwd")], by[(length, mode, "fwd+bwd")]
        lines.append(f"| {length} | {mode} | {f['favor_ms']:.2f} | {f['peer_ms']:.2f} | {f['median_ratio']:.2f} | "
                     f"{g['favor_ms']:.2f} | {g['peer_ms']:.2f} | {g['median_ratio']:.2f} |")
    return (f"{sections.heading(section, meta)}\n\n"
            f"favor's FAVOR+ (fixed draw, jitted) against performer-pytorch {meta['peer_version']} "
            f"(torch {meta['torch']}, {meta['torch_threads']} threads) on "
            f"{sections.where(meta)}; B = {B}, H = {H}, D = {D}, M = {M}, q, k, v ~ N(0, 0.25). Every program "
            f"per round in a random order, {meta['rounds']} rounds, each turn one untimed call and {meta['burst']} "
            f"timed (their mean); ms are minima, favor / peer the median of per-round ratios (below 1: favor "
            f"faster). Raw figures: bench/{section}.json.\n\n" + "\n".join(lines))


def add_parser(sub):
    pe = sub.add_parser("peers", help="favor's FAVOR+ against performer-pytorch, round-robin (the bench extra)")
    pe.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    pe.add_argument("--modes", default=",".join(MODES))
    pe.add_argument("--rounds", type=int, default=15)
    pe.add_argument("--out", default=".")
    pe.add_argument("--section", default="peers")


def main(args, flags, argv, parser):
    lengths = ints(parser, "--lengths", args.lengths)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--modes: unknown {', '.join(bad) or '(none given)'}; valid: {', '.join(MODES)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    runtime.keep_host_pages()
    times = peers(lengths, modes, args.rounds)
    table = rows(times)
    info = meta(args.rounds, argv)
    sections.publish(args.out, args.section, markdown(table, info, args.section),
                     {"meta": info, "rows": table, "times": {"/".join(map(str, k)): v for k, v in times.items()}})
    for r in table:
        print(f"L={r['length']:>5} {r['mode']:>13} {r['pass']:>7}: favor {r['favor_ms']:8.2f} ms, "
              f"peer {r['peer_ms']:8.2f} ms, favor/peer {r['median_ratio']:.2f}")
