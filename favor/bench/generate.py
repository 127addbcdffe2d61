"""`python -m favor.bench generate [--kinds softmax,favor+,favor++,favor+@64] [--lengths 512,...,8192]
[--tokens 32] [--rounds 3] [--preset mini] [--num_features 256]`: generation with a decoder, each kind
against softmax's key/value cache.

For every prompt length P and kind, a decoder of `--preset` (random weights: speed does not depend on
them) with max_positions P + tokens: the prefill (the prompt's causal pass, leaving the caches), then
`--tokens` tokens one at a time (the jitted decoding step favor.tools.generate runs, favor.models.generation). Figures per (P, kind):
prefill seconds, decoding tokens/s (batch 1; the median step), and the bytes of the caches decoding
carries. Each round runs every kind once at a length, in a fresh random order, so a burst of load on a
shared machine falls on all of them alike; ratios against softmax are medians of per-round ratios.
Writes BENCHMARKS.md section `generate`, bench/generate.json and bench/generate.png.
"""

from __future__ import annotations

import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from favor import attention, models
from favor.bench import sections
from favor.bench.common import ints, specs

KINDS = ("softmax", "favor+", "favor++", "favor+@64")
LENGTHS = (512, 1024, 2048, 4096, 8192)


def add_parser(sub):
    p = sub.add_parser("generate", help="decoding speed and state size against softmax's key/value cache")
    p.add_argument("--kinds", default=",".join(KINDS), help="kind specs, kind[:variant][@window], comma-separated")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths, comma-separated")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated after each prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--preset", default="mini", help="decoder preset (favor.config.presets)")
    p.add_argument("--num_features", type=int, default=256)
    p.add_argument("--out", default=".", help="where BENCHMARKS.md and bench/ are")
    return p


def _block(spec, num_features):
    kind, options = attention.parse_spec(spec)
    block = {"kind": kind, **options}
    if isinstance(attention.get(kind), attention.RandomFeatureAttention):
        block["num_features"] = num_features
    return block


def _program(spec, preset, length, tokens, num_features):
    """(prefill, step, prompt, state bytes) of a fresh decoder for `spec`, compiled and run once."""
    from favor.models.generation import decoding     # the programs generation runs, timed as it runs them
    model = models.get("decoder", preset, rngs=nnx.Rngs(0), attention=_block(spec, num_features),
                       max_positions=length + tokens)
    prefill, step = decoding(model, length + tokens)
    prompt = jax.random.randint(jax.random.key(1), (1, length), 0, model.config["vocab_size"])
    token, _, caches = jax.block_until_ready(prefill(prompt))
    jax.block_until_ready(step(token, jnp.asarray(length, jnp.int32), caches))
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(caches))
    return prefill, step, prompt, nbytes


def _run(prefill, step, prompt, tokens):
    """(prefill seconds, [seconds of each decoding step])."""
    t0 = time.perf_counter()
    token, _, caches = jax.block_until_ready(prefill(prompt))
    first = time.perf_counter() - t0
    steps = []
    for t in range(prompt.shape[1], prompt.shape[1] + tokens - 1):
        t0 = time.perf_counter()
        token, _, caches = jax.block_until_ready(step(token, jnp.asarray(t, jnp.int32), caches))
        steps.append(time.perf_counter() - t0)
    return first, steps


def measure(kinds, lengths, tokens, rounds, preset="mini", num_features=256, seed=0, log=print):
    """{length: {kind: {"prefill_s", "tokens_per_s", "state_bytes", and per round}}}."""
    rnd = random.Random(seed)
    out = {}
    for length in lengths:
        programs = {k: _program(k, preset, length, tokens, num_features) for k in kinds}
        per = {k: {"prefill": [], "step": []} for k in kinds}
        order = list(kinds)
        for _ in range(rounds):
            rnd.shuffle(order)
            for k in order:
                prefill, step, prompt, _ = programs[k]
                first, steps = _run(prefill, step, prompt, tokens)
                per[k]["prefill"].append(first)
                per[k]["step"].append(statistics.median(steps))
        out[length] = {k: {"prefill_s": min(per[k]["prefill"]), "tokens_per_s": 1.0 / min(per[k]["step"]),
                           "state_bytes": programs[k][3], "rounds": per[k]} for k in kinds}
        log(f"P = {length}: " + ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s, {v['state_bytes'] / 2**20:.2f} MiB"
                                         for k, v in out[length].items()))
    return out


def _ratio(per, k, ref, what):
    """Median over rounds of kind k's time against ref's (per-round pairs)."""
    return statistics.median(a / b for a, b in zip(per[k]["rounds"][what], per[ref]["rounds"][what]))


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = sorted(results)
    kinds = list(results[lengths[0]])
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    markers = "osD^vx*"
    for i, k in enumerate(kinds):
        style = dict(marker=markers[i % len(markers)], label=k, alpha=0.85)
        axes[0].plot(lengths, [results[n][k]["tokens_per_s"] for n in lengths], **style)
        # kinds of one feature width carry the same state: their lines coincide, the markers tell them apart
        axes[1].plot(lengths, [results[n][k]["state_bytes"] / 2**20 for n in lengths], **style)
    axes[0].set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="tokens / s (batch 1)",
                title="decoding speed after the prompt")
    axes[1].set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="MiB",
                title="state carried per sequence")
    for ax in axes:
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
    speeds = [results[n][k]["tokens_per_s"] for n in lengths for k in kinds]
    axes[0].set_yticks([t for t in 2.0 ** np.arange(-4, 20) if min(speeds) / 2 <= t <= max(speeds) * 2])
    axes[0].legend()
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results, meta, out_dir, reference="softmax"):
    lengths = sorted(results)
    kinds = list(results[lengths[0]])
    rows = ["| prompt | kind | prefill (s) | tokens/s | × softmax's tokens/s | state (MiB) | × softmax's state |",
            "|---|---|---|---|---|---|---|"]
    for n in lengths:
        r = results[n]
        for k in kinds:
            speed = f"{1.0 / _ratio(r, k, reference, 'step'):.2f}" if reference in r else "—"
            state = f"{r[k]['state_bytes'] / r[reference]['state_bytes']:.3f}" if reference in r else "—"
            rows.append(f"| {n} | {k} | {r[k]['prefill_s']:.3f} | {r[k]['tokens_per_s']:.0f} | {speed} | "
                        f"{r[k]['state_bytes'] / 2**20:.2f} | {state} |")
    body = "\n".join([sections.heading("generate", meta), "",
                      f"A `{meta['preset']}` decoder (random weights), batch 1, {meta['tokens']} tokens after each "
                      f"prompt, {meta['rounds']} rounds round-robin on {sections.where(meta)}. tokens/s: the "
                      "fastest round's median step; × softmax: the median over rounds of the per-round ratio. "
                      "State: the caches decoding carries (softmax: every key and value up to the last "
                      "position; linear kinds: the running feature sums, whatever the length; a window hybrid "
                      "adds its band's keys).", "", *rows, "", "![generation](bench/generate.png)"])
    path = sections.write_json(out_dir, "generate", {"meta": meta, "results": {str(n): r for n, r in results.items()}})
    plot(results, path.with_suffix(".png"))
    sections.replace_section(out_dir, "generate", body)


def main(args, flags, argv, parser):
    kinds = specs(parser, "--kinds", args.kinds)
    lengths = ints(parser, "--lengths", args.lengths)
    if args.tokens < 2 or args.rounds < 1:
        parser.error(f"--tokens must be ≥ 2 and --rounds ≥ 1; got {args.tokens} and {args.rounds}")
    if args.preset not in models.preset_names("decoder"):
        parser.error(f"--preset {args.preset!r}: valid: {', '.join(models.preset_names('decoder'))}")
    results = measure(kinds, lengths, args.tokens, args.rounds, args.preset, args.num_features)
    meta = sections.machine(argv, preset=args.preset, tokens=args.tokens, rounds=args.rounds)
    write(results, meta, args.out)
    return 0
