"""Attention over random features: every kind by the name users type.

    from favor import attention
    attention.names()
    attn = attention.get("favor++", num_features=256, coupling="orthogonal", redraw="step")
    out = attn(q, k, v, mask=None, causal=False, rng=key)   # q [B, Lq, H, D] -> [B, Lq, H, Dv]
    fn = attention.attention_fn("favor#", num_features=128)  # for nnx.MultiHeadAttention
"""

from favor.attention.dropin import attention_fn
from favor.registry import build
from favor.attention.kinds import KINDS, Attention, RandomFeatureAttention, RandomFeatureContext

_REGISTRY = {cls.name: cls for cls in KINDS}


def names():
    """Every attention kind."""
    return tuple(_REGISTRY)


def get(kind, **options):
    """An attention kind with options; an unknown kind or option is a ValueError listing valid ones."""
    return build("attention kind", _REGISTRY, kind, options)


def parse_spec(spec: str) -> tuple[str, dict]:
    """A kind spec as tools take it on the command line, `kind[:variant][@window]`, -> (kind, options):
    'favor#:saderf@16' -> ('favor#', {'variant': 'saderf', 'window': 16}); the variant sets the option
    the kind names (FAVOR#'s variant, HRF's lambda_, SimRF's features). A ValueError names a bad part
    and what is allowed."""
    body, at, window = str(spec).partition("@")
    kind, colon, variant = body.partition(":")
    if kind not in _REGISTRY:
        raise ValueError(f"unknown attention kind {kind!r} in {spec!r}; valid: {', '.join(_REGISTRY)}")
    cls, options = _REGISTRY[kind], {}
    if colon:
        if cls.SPEC_OPTION is None:
            with_variant = [name for name, c in _REGISTRY.items() if c.SPEC_OPTION]
            raise ValueError(f"{kind!r} has no variant (got {spec!r}); kinds with one: {', '.join(with_variant)}")
        options[cls.SPEC_OPTION] = variant
    if at:
        if "window" not in cls.OPTIONS or not window.isdigit():
            raise ValueError(f"{spec!r}: the part after '@' is a window, a whole number of tokens, for a "
                             f"random-feature kind; got {window!r}")
        options["window"] = int(window)
    get(kind, **options)            # a bad variant fails here, with the values allowed
    return kind, options


__all__ = ["Attention", "RandomFeatureAttention", "RandomFeatureContext", "attention_fn", "get", "names",
           "parse_spec"]
