"""Random-feature estimators of the softmax kernel SM(x, y) = exp(xᵀy).

    from favor import kernels
    kernels.names()
    mech = kernels.get("oprf")
    params = mech.fit(x, y)
    w = mech.draw(key, 256, params, coupling="orthogonal")
    est = mech.query_features(x, w, params) @ mech.key_features(y, w, params).T

See favor/kernels/base.py for the full interface and ../shared/MATH.md for the formulas.
"""

from favor.kernels.base import Mechanism
from favor.kernels.couplings import COUPLINGS, Projections, draw
from favor.kernels.registry import get, names, options

__all__ = ["COUPLINGS", "Mechanism", "Projections", "draw", "get", "names", "options"]
