"""The kernel registry: mechanisms keyed by the names users type."""

from __future__ import annotations

from favor.kernels import discrete, exponential, hybrid, trig
from favor.kernels.base import Mechanism
from favor.registry import build

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
    return dict(build("kernel mechanism", _REGISTRY, name, {}).OPTIONS)


def get(name: str, **opts) -> Mechanism:
    """A mechanism by registry name; an unknown name or option is a ValueError listing valid ones."""
    return build("kernel mechanism", _REGISTRY, name, opts)
