"""Linear attention over feature maps: the O(L) cores every random-feature kind shares.

Shapes: features fq [B, H, Lq, F], fk [B, H, Lk, F] (already stabilised, exponentiated and with
padded keys zeroed), values v [B, H, Lk, Dv]. Sequence reductions and the carried prefix state
accumulate in float32 whatever the input dtype.

    Y = diag(Φ_q (Φ_kᵀ 1))⁻¹ Φ_q (Φ_kᵀ V)                     (bidirectional)
    Y_i = φ_q(i)ᵀ Σ_{j≤i} φ_k(j) v_jᵀ / φ_q(i)ᵀ Σ_{j≤i} φ_k(j)   (causal)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEN_EPS = 1e-6   # denominators are O(1) or larger after stabilisation; this only guards 0 and sign


def guard(den, positive):
    """Keep a denominator away from zero. Positive features: den ≥ 0 and 0 only for an all-padding
    row; sign-indefinite features (trig, HRF): keep the sign, floor the magnitude."""
    if positive:
        return jnp.maximum(den, DEN_EPS)
    return jnp.where(den >= 0, jnp.maximum(den, DEN_EPS), jnp.minimum(den, -DEN_EPS))


def bidirectional(fq, fk, v, positive=True):
    f32 = jnp.float32
    kv = jnp.einsum("bhlf,bhld->bhfd", fk, v, preferred_element_type=f32)
    z = jnp.sum(fk.astype(f32), axis=2)
    num = jnp.einsum("bhlf,bhfd->bhld", fq, kv.astype(fq.dtype), preferred_element_type=f32)
    den = jnp.einsum("bhlf,bhf->bhl", fq.astype(f32), z)
    return num / guard(den, positive)[..., None]


def causal(fq, fk, v, positive=True, chunk_size=64):
    """Chunked causal linear attention: exact masked block inside each chunk, prefix state between.

    Memory O(L·(F + Dv)) plus one [F, Dv] state per batch and head; never O(L·F·Dv).
    """
    b, h, l, f = fq.shape
    dv = v.shape[-1]
    c = min(chunk_size, l)
    pad = (-l) % c
    if pad:
        widths = ((0, 0), (0, 0), (0, pad), (0, 0))
        fq, fk, v = jnp.pad(fq, widths), jnp.pad(fk, widths), jnp.pad(v, widths)
    n = (l + pad) // c
    split = lambda a: jnp.moveaxis(a.reshape(b, h, n, c, a.shape[-1]), 2, 0)
    tril = jnp.tril(jnp.ones((c, c), bool))
    f32 = jnp.float32

    def step(carry, chunk):
        s, z = carry                                  # [B,H,F,Dv], [B,H,F] float32
        q_c, k_c, v_c = chunk
        scores = jnp.einsum("bhif,bhjf->bhij", q_c, k_c, preferred_element_type=f32)
        scores = jnp.where(tril, scores, 0.0)
        num = (jnp.einsum("bhij,bhjd->bhid", scores, v_c.astype(f32))
               + jnp.einsum("bhif,bhfd->bhid", q_c.astype(f32), s))
        den = jnp.sum(scores, -1) + jnp.einsum("bhif,bhf->bhi", q_c.astype(f32), z)
        s = s + jnp.einsum("bhjf,bhjd->bhfd", k_c, v_c, preferred_element_type=f32)
        z = z + jnp.sum(k_c.astype(f32), axis=2)
        return (s, z), num / guard(den, positive)[..., None]

    init = (jnp.zeros((b, h, f, dv), f32), jnp.zeros((b, h, f), f32))
    _, out = jax.lax.scan(step, init, (split(fq), split(fk), split(v)))
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv)
    return out[:, :, :l]
