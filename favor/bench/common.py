"""What the attention benchmarks share: the shapes, timing, compilation (peak memory and FLOPs), the
same-FLOP matmul yardstick, and how a kind spec becomes the benchmarked layer."""

from __future__ import annotations

import os
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from favor import attention, strings

B, H, D, M = 1, 4, 64, 256


def timed(fn, args, repeats, min_seconds=0.3):
    jax.block_until_ready(fn(*args))                  # warm (compiled already)
    times = []
    t_start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - t_start < min_seconds and len(times) < 50):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def round_robin(programs, rounds, seed=0, warm=True):
    """{name: [seconds of each round]} of `programs` ({name: (function, arguments, factor on its time)}),
    each warmed once (unless the caller has: warm=False), then timed round by round, every round running
    each program once in a fresh random order: a burst of load on a shared machine falls on all of them
    alike, so per-round ratios hold."""
    times = {name: [] for name in programs}
    order = list(programs)
    rnd = random.Random(seed)
    for fn, args, _ in programs.values() if warm else ():
        jax.block_until_ready(fn(*args))
    for _ in range(rounds):
        rnd.shuffle(order)
        for name in order:
            fn, args, factor = programs[name]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - t0) * factor)
    return times


def peak_bytes(compiled):
    """XLA's planned peak memory of a compiled program: arguments, outputs and temporaries (None where the
    backend gives no memory analysis)."""
    mem = compiled.memory_analysis()
    return None if mem is None else int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                        + mem.temp_size_in_bytes)


def compile_fn(fn, args):
    compiled = jax.jit(fn).lower(*args).compile()
    peak = peak_bytes(compiled)
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
    return timed(f, args, repeats) * scale


def kind_options(spec):
    """A kind spec (favor.attention.parse_spec: 'favor#:saderf', 'favor+@64') as the benchmarks run it:
    random-feature kinds at one feature width M (equal [L, F] cost) and redrawn every call."""
    kind, opts = attention.parse_spec(spec)
    if "num_features" in attention.get(kind).OPTIONS:
        opts = {"num_features": M, "redraw": "step", **opts}
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


def layer_fn(attn, causal, stats, grad, segment_ids=None):
    """The benchmarked function of (q, k, v, rng): the layer's forward, or with `grad` its forward and
    backward (d/d(q, k, v) of the outputs' sum); `segment_ids` [B, L]: packed documents."""
    def f(q, k, v, rng):
        out = lambda q, k, v: attn(q, k, v, causal=causal, rng=rng, stats=stats, segment_ids=segment_ids)
        return jax.grad(lambda *a: jnp.sum(out(*a)), argnums=(0, 1, 2))(q, k, v) if grad else out(q, k, v)
    return f


def flops_of(attn, causal, q, k, v, rng, stats, grad):
    return compile_fn(layer_fn(attn, causal, stats, grad), (q, k, v, rng))[2]


def counted_flops(attn, twin, causal, args, stats, grad, flops):
    """The FLOPs of `attn`'s program, whose own cost analysis gave `flops`: those when its FLOP twin
    (`flop_twin`) traces to the same program — at short lengths the layer runs one chunk and one span,
    with no loop for the analysis to undercount —, else the twin's, compiled for it (a second compile,
    the bench's slowest part at short lengths, made only when it counts something else)."""
    if twin is attn:
        return flops
    trace = lambda a: str(jax.make_jaxpr(layer_fn(a, causal, stats, grad))(*args))
    return flops if trace(twin) == trace(attn) else flops_of(twin, causal, *args, stats, grad=grad)


def setup(spec, length, causal, documents=False):
    """(layer, its FLOP twin, (q, k, v, rng), stats) of one benchmarked kind. `documents`: the rows are
    packed documents (`packed_segments`), whose data-dependent fits read statistics in either mode."""
    kind, opts = kind_options(spec)
    attn = attention.get(kind, **opts)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (0.5 * jax.random.normal(kk, (B, length, H, D)) for kk in ks[:3])
    # causal data-dependent kinds fit on statistics from outside the sequence (what a causal model's
    # running statistics give): fitted once here, outside the timed function
    fitted = (causal or documents) and getattr(attn, "data_dependent", False)
    stats = attn.statistics(q, k) if fitted else None
    return attn, flop_twin(kind, opts, length, causal), (q, k, v, ks[3]), stats


# packed rows for the documents entries: DOCUMENTS documents a row, of lengths drawn once (a seeded
# geometric spread around L / DOCUMENTS, as a packer of real text makes them)
DOCUMENTS = 8


def packed_segments(length, documents=DOCUMENTS):
    """segment ids [B, L] of `documents` documents a row (ids 0, 1, ...; the lengths' seed fixed)."""
    if not 1 <= documents <= length:
        raise ValueError(f"{documents} documents do not fit a row of {length} tokens")
    weights = np.random.default_rng(0).exponential(size=(B, documents))
    lengths = 1 + np.floor(weights / weights.sum(1, keepdims=True) * (length - documents)).astype(int)
    lengths[:, -1] += length - lengths.sum(1)                  # every document ≥ 1 token, the row full
    return jnp.asarray(np.stack([np.repeat(np.arange(documents), n) for n in lengths]), jnp.int32)


def ints(parser, flag, text):
    """A list of positive integers (favor.strings: "," or "/" between them), or the parser's error naming
    the flag and the value."""
    try:
        return strings.positive_ints(flag, text)
    except ValueError as e:
        parser.error(str(e))


def specs(parser, flag, text):
    """A list of kind specs (favor.attention.parse_specs), each checked, or the parser's error naming
    the flag and what is wrong."""
    try:
        return [spec for spec, _, _ in attention.parse_specs(flag, text)]
    except ValueError as e:
        parser.error(str(e))


def choices(parser, flag, text, allowed):
    """A list of values from `allowed` (favor.strings.choices), or the parser's error naming the flag and them."""
    try:
        return list(strings.choices(flag, text, allowed, nonempty=True))
    except ValueError as e:
        parser.error(str(e))
