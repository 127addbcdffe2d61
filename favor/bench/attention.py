"""`python -m favor.bench attention`: every attention kind, bidirectional and causal, forward and
forward+backward, against exact softmax and a square matmul of the same FLOP count (XLA's cost analysis of
the compiled kind; XLA counts a loop's body once, so a bidirectional feature kind's FLOPs are counted on
its one-chunk program: the same operations, not split into a scan over chunks). Peak memory is XLA's
compiled buffer footprint (arguments + outputs + temporaries) of the jitted function. A kind may carry its
variant and window (favor.attention.parse_spec): `favor#:saderf`, `hrf:gaussian`, `favor+@64`."""

from __future__ import annotations

import time
from pathlib import Path

import jax

from favor import attention, runtime
from favor.bench import sections
from favor.bench.common import (B, D, H, M, compile_fn, counted_flops, ints, layer_fn, matmul_seconds,
                                memory_budget, setup, specs, timed)

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


def measure(spec, length, causal, repeats):
    attn, twin, (q, k, v, rng), stats = setup(spec, length, causal)

    row = {"kind": spec, "length": length, "causal": causal}
    for name in ("fwd", "fwd_bwd"):
        grad = name == "fwd_bwd"
        compiled, peak, flops = compile_fn(layer_fn(attn, causal, stats, grad), (q, k, v, rng))
        if peak is not None and peak > memory_budget():
            # exact softmax at 16k: running it would get the process OOM-killed, losing the run
            row[name] = {"seconds": None, "peak_bytes": peak, "flops": flops, "matmul_seconds": None,
                         "skipped": f"needs {peak / 2 ** 30:.1f} GiB > budget {memory_budget() / 2 ** 30:.1f} GiB"}
            continue
        flops = counted_flops(attn, twin, causal, (q, k, v, rng), stats, grad, flops)
        seconds = timed(compiled, (q, k, v, rng), repeats)
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


def _over(a, b):
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
            r["length"], mode, r["kind"], skip(f, fmt(ms(f["seconds"]))), fmt(_over(f["seconds"], f["matmul_seconds"])),
            fmt(_over(f["seconds"], sm.get("fwd", {}).get("seconds"))), skip(fb, fmt(ms(fb["seconds"]))),
            fmt(_over(fb["seconds"], fb["matmul_seconds"])),
            fmt(_over(sm.get("fwd_bwd", {}).get("seconds"), fb["seconds"]), "{:.1f}"),
            fmt(None if fb["peak_bytes"] is None else fb["peak_bytes"] / 2 ** 20, "{:.0f}")))
    return "\n".join(lines)


def write(rows, out_dir, argv, section="attention-benchmark"):
    meta = sections.machine(argv, devices=str(jax.devices()), malloc_keeps_pages=runtime.keep_host_pages(),
                            B=B, H=H, D=D, M=M)
    name = "attention" if section == "attention-benchmark" else section
    body = (f"{sections.heading(section, meta)}\n\n"
            f"B = {B}, H = {H}, D = {D}, feature width F = {M} for every kind, float32, "
            f"{sections.where(meta)}, malloc keeps freed pages: "
            f"{meta['malloc_keeps_pages']} (favor/runtime.py). Ratios are within this one run; "
            f"'matmul' is a square matmul with the kind's own FLOP count. Raw figures: bench/{name}.json.\n\n"
            f"{table(rows)}")
    sections.publish(out_dir, section, body, {"meta": meta, "rows": rows}, json_name=name)


def add_parser(sub):
    p = sub.add_parser("attention", help="every attention kind, bidirectional and causal")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--kinds", default=",".join(attention.names() + ("favor#:saderf",)))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=".")
    p.add_argument("--section", default="attention-benchmark",
                   help="BENCHMARKS.md section (and bench/<section>.json) this run replaces")


def main(args, flags, argv, parser):
    kinds = specs(parser, "--kinds", args.kinds)
    lengths = ints(parser, "--lengths", args.lengths)
    runtime.keep_host_pages()   # for every kind and the yardsticks alike; see favor/runtime.py
    run(kinds, lengths, args.repeats, args.out, lambda rows: write(rows, args.out, argv, args.section))
    print(f"wrote {Path(args.out) / 'BENCHMARKS.md'} and {Path(args.out) / 'bench' / 'attention.json'}")
