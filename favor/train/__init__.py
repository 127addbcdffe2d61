"""The training engine: step functions (steps), the loop (loop), stages before the main training
(stage), the optimizer (optim). favor.job assembles a run from a config with them."""
