"""What configs are made of, importing no JAX: the blocks and arg strings configs/*.py are written with
(blocks), the typed checks of every block (checks), loading a config file as --config does (loading),
and the model sizes (presets)."""
