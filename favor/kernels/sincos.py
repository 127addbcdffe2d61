"""sin and cos together, as a vectorisable polynomial: the trigonometric features' main cost.

XLA:CPU evaluates jnp.sin / jnp.cos element by element (7–8 ns each here, against ~2 ns for exp), which
made trig ("favor") attention 3× FAVOR+'s time at L = 8192 for sin and cos alone. This shares one
range reduction between both and uses polynomials XLA fuses and vectorises:

    n = round(x·2/π),  r = x − n·π/2  (π/2 split in three parts: n·P1 is exact for |n| < 2¹⁶),
    sin r, cos r by Cephes' single-precision minimax polynomials on |r| ≤ π/4,
    then the quadrant n mod 4 swaps and negates them.

Accuracy (float32, against float64): |error| < 1e-7 for |x| ≤ 1e5 (tests/test_estimators.py, `test_sincos_*`); beyond
that the three-part reduction is no longer exact and the call falls back to jnp.sin / jnp.cos (one
max over |x| decides for the whole array). Derivatives are the exact ones, d sin = cos, d cos = −sin,
evaluated with the same values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

P1, P2, P3 = 1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8   # π/2 = P1 + P2 + P3
TWO_OVER_PI = 0.636619772367581343
LIMIT = 1.0e5            # 2¹⁶·π/2 ≈ 1.03e5: n·P1 exact below it
SIN = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)              # Cephes sinf, r + r³·p(r²)
COS = (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2)  # cosf, 1 − r²/2 + r⁴·p(r²)


def _polynomial(x):
    n = jnp.round(x * TWO_OVER_PI)
    r = ((x - n * P1) - n * P2) - n * P3
    z = r * r
    s = ((SIN[0] * z + SIN[1]) * z + SIN[2]) * z * r + r
    c = ((COS[0] * z + COS[1]) * z + COS[2]) * z * z - 0.5 * z + 1.0
    quadrant = n.astype(jnp.int32) & 3
    odd = (quadrant & 1) == 1
    sin, cos = jnp.where(odd, c, s), jnp.where(odd, s, c)
    return jnp.where(quadrant >= 2, -sin, sin), jnp.where((quadrant == 1) | (quadrant == 2), -cos, cos)


@jax.custom_jvp
def sincos(x):
    """(sin x, cos x) for a float32 array."""
    x = jnp.asarray(x, jnp.float32)
    return jax.lax.cond(jnp.max(jnp.abs(x), initial=0.0) < LIMIT, _polynomial,
                        lambda x: (jnp.sin(x), jnp.cos(x)), x)


@sincos.defjvp
def _sincos_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    s, c = sincos(x)
    return (s, c), (c * dx, -s * dx)


def sin_cos_features(proj):
    """[..., 2M] = [sin(proj), cos(proj)]: the trigonometric feature values of projections [..., M]."""
    return jnp.concatenate(sincos(proj), axis=-1)
