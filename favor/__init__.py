"""favor: random-feature attention in JAX/Flax."""

from favor import runtime as _runtime

# before JAX starts its CPU backend: XLA:CPU's concurrent scheduler can deadlock LAPACK calls (runtime)
_runtime.cpu_scheduler()
