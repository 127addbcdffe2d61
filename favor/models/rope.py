"""Rotary position frequencies: RoFormer's, and the rescalings long-context checkpoints are trained with.

A scaling is a string a config carries (`model.rope_scaling`), empty for none:

    linear:factor=F         every frequency divided by F (position interpolation, Chen et al. 2023)
    llama3:factor=F,low_freq_factor=a,high_freq_factor=b,original_max_position_embeddings=N
                            Llama 3.1's: wavelengths longer than N / a are divided by F, those shorter
                            than N / b kept, those between interpolated smoothly

Both change only the frequencies, fixed numbers per head dimension, so queries and keys are rotated as
before and every attention kind, causal state and decoding cache takes them unchanged. Rescalings whose
frequencies depend on the sequence's length (dynamic NTK) or that also scale the logits (YaRN, LongRoPE)
are refused by name: a model of favor's would silently compute otherwise.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from favor import strings

PARAMETERS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
FORMS = ("'' (none), 'linear:factor=F' or 'llama3:factor=F,low_freq_factor=a,high_freq_factor=b,"
         "original_max_position_embeddings=N'")


def parse(spec: str) -> tuple[str, dict[str, float]]:
    """"llama3:factor=8,..." -> ("llama3", {"factor": 8.0, ...}); ("", {}) for ""; a ValueError naming
    the spec and the forms allowed otherwise."""
    spec = str(spec or "").strip()
    if not spec:
        return "", {}
    kind, _, rest = spec.partition(":")
    if kind not in PARAMETERS:
        raise ValueError(f"rope scaling {spec!r}: unknown type {kind!r}; valid: {FORMS}")
    values = {}
    for item in strings.items(rest):
        key, _, value = item.partition("=")
        try:
            values[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"rope scaling {spec!r}: {item!r} is not key=number; valid: {FORMS}") from None
    if set(values) != set(PARAMETERS[kind]):
        raise ValueError(f"rope scaling {spec!r}: {kind} takes exactly {', '.join(PARAMETERS[kind])}; valid: {FORMS}")
    if values["factor"] <= 0 or (kind == "llama3" and not (0 < values["low_freq_factor"] < values["high_freq_factor"]
                                                          and values["original_max_position_embeddings"] > 0)):
        raise ValueError(f"rope scaling {spec!r}: factor and original_max_position_embeddings must be positive and "
                         f"0 < low_freq_factor < high_freq_factor")
    return kind, values


def spec(kind: str, values: dict) -> str:
    """The string `parse` reads back: the type, then its parameters in PARAMETERS' order."""
    if not kind:
        return ""
    return f"{kind}:" + ",".join(f"{k}={float(values[k]):g}" for k in PARAMETERS[kind])


@functools.lru_cache(maxsize=64)
def frequencies(head_dim: int, base: float, scaling: str = "") -> np.ndarray:
    """The head_dim / 2 rotary frequencies base^(-2i / head_dim), rescaled as `scaling` says (float32)."""
    if head_dim % 2:
        raise ValueError(f"rotary positions need an even head dim; got {head_dim}")
    freqs = float(base) ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim)
    kind, p = parse(scaling)
    if kind == "linear":
        freqs = freqs / p["factor"]
    elif kind == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelength = 2.0 * math.pi / freqs
        # the share of a wavelength's full rescaling it takes: 1 below old / high (kept), 0 above old / low
        keep = np.clip((old / wavelength - low) / (high - low), 0.0, 1.0)
        freqs = keep * freqs + (1.0 - keep) * freqs / factor
    return freqs.astype(np.float32)
