"""Query/key normalisation before any attention kind: the options and the pure array maps.

An attention block (`config.model.attention`, `models.get(..., attention=...)`, `attention_fn`) may carry

    qk_norm       ""         none: queries and keys as the projections give them (Hugging Face imports)
                  "l2"       each head's queries and keys put on one sphere of radius r, a learned per-head
                             parameter: x = r·q/‖q‖, y = r·k/‖k‖ for the kernel, so xᵀy = r²·cos θ
                  "layernorm" QK-LayerNorm: LayerNorm over each head's dim (learned scale and bias shared
                             by the heads), as ViT-22B and OLMo-2 use
    qk_radius     1.0        the radius r at initialisation ("l2")
    qk_radius_max 2.0        the radius never exceeds it: r = r_max·sigmoid(ρ), ρ the learned parameter

Why "l2" is parameterised this way (the papers and measurement; README "Query/key normalisation"):
- Every random-feature estimator's variance grows with the norms: FAVOR+'s relative second moment of a
  pair is e^(‖x+y‖²), trig's e^(‖x−y‖²)-like (HRF Lemma 2.2), so on the sphere S(r) both are at most
  e^(4r²) per feature: bounded by the radius alone, whatever the projections learn. HRF's theorems are
  stated on S(r) with same-length queries and keys, and its angular λ is then exact (HRF §3), which one
  radius shared by queries and keys gives; at a fixed product r_q·r_k (the softmax logit's scale) equal
  radii also minimise ‖x+y‖², the positive features' variance.
- One radius per head, not per side: only r² reaches the softmax logits, and the two sides' norms are
  what the estimators pay for.
- Bounded by a sigmoid rather than clipped: a clip has no gradient at the bound, so a head that hits it
  stays there; the sigmoid keeps every radius in (0, r_max) with a gradient everywhere.
- r0 = 1 (the HRF paper's Fig. 2 sphere; logits in [−1, 1] at the start, where every kernel is
  accurate: relative variance e^4/M at worst per pair), r_max = 2 (logits in [−4, 4], a 3000:1 range of
  attention weights; trig's typical per-pair relative variance e^(2r²)/2M stays below 1 for M ≥ 64 at
  r ≤ 1.5 and reaches e^8/2M at 2). The training loss sees the estimator's noise, so each head learns its
  own trade-off between sharper attention and a noisier estimate inside that range.

The sphere is applied in the layer (favor.models.layers.SelfAttention, the NNX drop-in) before rotary
positions (which preserve norms) and before the kind's own D^(−1/4) scaling: the layer scales the unit
vectors by r·D^(1/4), so softmax's qᵀk/√D and the kernels' xᵀy are both r²·cos θ.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from favor.config import blocks

NORMS = ("", "l2", "layernorm")
OPTIONS = blocks.QK_NORM_OPTIONS
EPS = 1e-6


def split(options: dict) -> tuple[dict, dict]:
    """An attention block's options -> (the kind's options, the qk options with defaults filled),
    checked: an unknown qk_norm or a radius outside (0, qk_radius_max) is a ValueError naming it."""
    kind_opts = {k: v for k, v in options.items() if k not in OPTIONS}
    qk = {**OPTIONS, **{k: v for k, v in options.items() if k in OPTIONS}}
    check(qk)
    return kind_opts, qk


class OptionError(ValueError):
    """A bad qk option; `key` names it."""

    def __init__(self, key, message):
        super().__init__(message)
        self.key = key


def check(qk: dict) -> dict:
    norm = qk.get("qk_norm", "")
    if norm not in NORMS:
        raise OptionError("qk_norm", f"unknown qk_norm {norm!r}; valid: {', '.join(map(repr, NORMS))}")
    r0, rmax = qk.get("qk_radius", OPTIONS["qk_radius"]), qk.get("qk_radius_max", OPTIONS["qk_radius_max"])
    for key, value in (("qk_radius", r0), ("qk_radius_max", rmax)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise OptionError(key, f"{key} must be a finite number > 0; got {value!r}")
    if not r0 < rmax:
        raise OptionError("qk_radius", f"qk_radius must be below qk_radius_max (the radius is "
                                       f"qk_radius_max·sigmoid(ρ)); got qk_radius={r0!r}, qk_radius_max={rmax!r}")
    return qk


def initial_logit(r0: float, rmax: float) -> float:
    """ρ with rmax·sigmoid(ρ) = r0."""
    p = r0 / rmax
    return math.log(p / (1.0 - p))


def radius(logit, rmax):
    """The radius rmax·sigmoid(ρ) of each head, float32."""
    return rmax * jax.nn.sigmoid(jnp.asarray(logit, jnp.float32))


def on_sphere(q, k, r):
    """q, k [B, L, H, D] -> each row on the sphere of radius r [H]·D^(1/4) (float32 norms, the inputs'
    dtype out), so that qᵀk/√D = r²·cos θ. A zero row stays zero."""
    d = q.shape[-1]
    scale = (jnp.asarray(r, jnp.float32) * d ** 0.25)[:, None]                   # [H, 1]

    def unit(a):
        a32 = a.astype(jnp.float32)
        return (a32 * jax.lax.rsqrt(jnp.sum(a32 * a32, -1, keepdims=True) + EPS) * scale).astype(a.dtype)

    return unit(q), unit(k)
