"""`python -m favor.bench parts`: FAVOR+'s forward against the cost of its unavoidable parts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from favor import attention, runtime
from favor.bench import sections
from favor.bench.common import (B, D, H, M, compile_fn, counted_flops, flop_twin, kind_options, layer_fn,
                                matmul_seconds, timed)


def parts(length, repeats):
    """FAVOR+'s bidirectional forward and its unavoidable parts, each timed alone in its own shapes as
    XLA:CPU runs them, in units of the forward's same-FLOP square matmul (one run): where the roofline
    target (1.5×) stands against what the parts cost even if everything between them fused."""
    kind, opts = kind_options("favor+")
    attn = attention.get(kind, **opts)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (0.5 * jax.random.normal(kk, (B, length, H, D)) for kk in ks[:3])
    compiled, _, own = compile_fn(layer_fn(attn, False, None, False), (q, k, v, ks[3]))
    flops = counted_flops(attn, flop_twin(kind, opts, length, False), False, (q, k, v, ks[3]), None, False, own)
    yard = matmul_seconds(flops, repeats)
    n, f32 = B * H * length, jnp.float32
    x = jax.random.normal(ks[0], (n, D + 2), f32)             # [u, ‖u‖², 1]: the library's one-matmul form
    w = jax.random.normal(ks[1], (D + 2, M), f32)
    logits = jax.random.normal(ks[2], (B, H, length, M), f32)
    v1 = jax.random.normal(ks[3], (B, H, length, D + 1), f32)
    vk = jax.random.normal(ks[3], (B, H, D + 1, M), f32)
    rows = [
        ("FAVOR+ forward (the library)", timed(compiled, (q, k, v, ks[3]), repeats)),
        ("2 projections [B·H·L, D+2] @ [D+2, M]", 2 * timed(jax.jit(lambda x, w: x @ w), (x, w), repeats)),
        ("2 exp over [B, H, L, M], written", 2 * timed(jax.jit(jnp.exp), (logits,), repeats)),
        ("2 exp over [B, H, L, M], consumed in place (a fused kernel's cost)",
         2 * timed(jax.jit(lambda a: jnp.sum(jnp.exp(a), -1)), (logits,), repeats)),
        ("[V,1]ᵀΦ_k contraction", timed(jax.jit(lambda a, b: jnp.einsum("bhld,bhlf->bhdf", a, b)),
                                          (v1, logits), repeats)),
        ("Φ_q (Φ_kᵀ[V,1]) contraction", timed(jax.jit(lambda a, b: jnp.einsum("bhlf,bhdf->bhld", a, b)),
                                               (logits, vk), repeats)),
    ]
    t = dict(rows)
    floor = (t["2 projections [B·H·L, D+2] @ [D+2, M]"] + t["[V,1]ᵀΦ_k contraction"]
             + t["Φ_q (Φ_kᵀ[V,1]) contraction"] + t["2 exp over [B, H, L, M], consumed in place (a fused kernel's cost)"])
    rows.append(("sum of the parts with perfect fusion (matmuls + in-place exp)", floor))
    return [{"part": name, "seconds": sec, "ratio": sec / yard} for name, sec in rows], yard, flops


def add_parser(sub):
    pp = sub.add_parser("parts", help="FAVOR+'s forward against the cost of its parts (the roofline target)")
    pp.add_argument("--length", type=int, default=8192)
    pp.add_argument("--repeats", type=int, default=5)
    pp.add_argument("--out", default=".")


def main(args, flags, argv, parser):
    runtime.keep_host_pages()
    rows, yard, flops = parts(args.length, args.repeats)
    meta = sections.machine(argv)
    table_rows = "\n".join(f"| {r['part']} | {r['seconds'] * 1e3:.2f} | {r['ratio']:.2f} |" for r in rows)
    body = (f"{sections.heading('favor-plus-parts', meta)}\n\n"
            f"L = {args.length}, B = {B}, H = {H}, D = {D}, M = {M}, float32, "
            f"{sections.where(meta)}. Each part timed alone (median of "
            f"{args.repeats}); ratios to a square matmul of the forward's {flops / 1e9:.2f} GFLOP "
            f"({yard * 1e3:.2f} ms), all in this one run.\n\n| part | ms | / matmul |\n|---|---|---|\n"
            f"{table_rows}")
    sections.publish(args.out, "favor-plus-parts", body,
                     {"length": args.length, "matmul_seconds": yard, "flops": flops, "rows": rows})
    print(table_rows)
