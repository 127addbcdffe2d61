"""Data sources, one small interface for all of them, keyed by the name a config gives.

A source yields host-local numpy batches:

    source.train_batches(batch_size, start_step, seed)  # infinite, deterministic in (seed, step):
                                                          # a resumed run continues where it stopped
    source.eval_batches(batch_size)                       # the whole eval split once; short last batch
                                                          # padded, with batch["valid"] marking real rows

`batch_size` is global; each process gets rows [i·B/P, (i+1)·B/P) of every global batch, so the
sharded loop assembles global arrays from the local slices (favor.sharding.global_batch).
"""

from __future__ import annotations

from favor.registry import build


def _registry():
    from favor.data.digits import Digits
    from favor.data.glue import Glue
    return {"digits": Digits, "glue": Glue}


def names():
    return tuple(_registry())


def get(config):
    """The source a `config.data` block names (its other keys are the source's options)."""
    options = dict(config)
    name = options.pop("name", None)
    return build("dataset", _registry(), name, options)
