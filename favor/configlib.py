"""What every configs/*.py shares: the arg string after the file name, and the run-loop keys.

    python train.py --config configs/<file>.py:data=local,kind=favor#,runlocal ...
"""

from __future__ import annotations

import ml_collections

from favor.sharding import DEFAULT_RULES


def parse_arg(arg, valid, where: str) -> dict:
    """"a=1,b,c=x" -> {"a": "1", "b": True, "c": "x"}; a key outside `valid` is an error naming it."""
    out = {}
    for part in filter(None, (arg or "").split(",")):
        key, _, value = part.partition("=")
        value = value.strip()
        # "runlocal", "runlocal=true" -> True; "runlocal=false" -> False; anything else stays a string
        out[key.strip()] = {"": True, "true": True, "false": False}.get(value.lower(), value)
    bad = sorted(set(out) - set(valid))
    if bad:
        raise ValueError(f"{where}: unknown arg(s) {', '.join(bad)}; valid: {', '.join(valid)}")
    return out


def choice(args: dict, key: str, default: str, allowed, where: str) -> str:
    value = args.get(key, default)
    if value not in allowed:
        raise ValueError(f"{where}: unknown {key} {value!r}; valid: {', '.join(allowed)}")
    return value


def run_config(*, total_steps: int, batch_size: int, eval_batch_size: int, every: int, log_every: int = 100,
               keep_checkpoints: int = 2, seed: int = 0) -> ml_collections.ConfigDict:
    """The run-loop keys (checkpoints and evals every `every` steps; the mesh all data-parallel)."""
    c = ml_collections.ConfigDict()
    c.seed = seed
    c.total_steps, c.batch_size, c.eval_batch_size = total_steps, batch_size, eval_batch_size
    c.checkpoint_every, c.eval_every, c.log_every, c.keep_checkpoints = every, every, log_every, keep_checkpoints
    c.mesh = {"data": -1, "fsdp": 1, "tensor": 1}
    c.sharding_rules = dict(DEFAULT_RULES)
    c.prefetch = 2                     # host batches read ahead on a thread (0: read in the loop)
    return c
