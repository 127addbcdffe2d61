"""The kernel registry: mechanisms keyed by the names users type."""

from __future__ import annotations

from favor.kernels import discrete, exponential, hybrid, trig
from favor.registry import Registry

REGISTRY = Registry("kernel mechanism", {
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
})


names = REGISTRY.names      # every registered mechanism name
get = REGISTRY.build        # get(name, **opts); an unknown name or option is a ValueError listing valid ones


def options(name: str) -> dict:
    """The options a mechanism accepts, with their defaults."""
    return dict(REGISTRY.lookup(name).OPTIONS)
