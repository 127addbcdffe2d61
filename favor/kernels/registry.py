"""The kernel registry: mechanisms keyed by the names users type."""

from __future__ import annotations

from favor.kernels import discrete, exponential, hybrid, trig
from favor.kernels.base import Mechanism

_REGISTRY: dict[str, type[Mechanism]] = {
    cls.name: cls
    for cls in (
        trig.Trig,
        exponential.Positive,
        exponential.GERF,
        exponential.OPRF,
        exponential.SADERF,
        exponential.ADERF,
        exponential.SDERF,
        discrete.Poisson,
        discrete.PoissonPlus,
        discrete.Geometric,
        discrete.GeometricPlus,
        hybrid.HybridAngular,
        hybrid.HybridGaussian,
        hybrid.HybridCluster,
    )
}


def names() -> tuple[str, ...]:
    """Every registered mechanism name."""
    return tuple(_REGISTRY)


def options(name: str) -> dict:
    """The options a mechanism accepts, with their defaults."""
    return dict(_cls(name).OPTIONS)


def _cls(name):
    if name not in _REGISTRY:
        raise ValueError(f"unknown kernel mechanism {name!r}; valid names: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def get(name: str, **opts) -> Mechanism:
    """A mechanism by registry name; an unknown name or option is a ValueError listing valid ones."""
    cls = _cls(name)
    bad = sorted(set(opts) - set(cls.OPTIONS))
    if bad:
        valid = ", ".join(f"{k}={v!r}" for k, v in cls.OPTIONS.items()) or "none"
        raise ValueError(f"kernel {name!r} got unknown option(s) {', '.join(map(repr, bad))}; "
                         f"valid options: {valid}")
    return cls(**{**cls.OPTIONS, **opts})
