"""Device mesh, logical-axis rules and global batches.

The mesh has four named axes: "data" (batch), "fsdp" (batch and parameter shards), "sequence" (the
activations' length axis, context parallelism: favor.attention.sequence) and "tensor" (heads / mlp /
vocab shards). `config.mesh` gives their sizes; one may be -1 to take the devices
the others leave. Model parameters carry logical axis names (favor.models.layers.AXES), and
`config.sharding_rules` maps each to a mesh axis (or None); a dim that the mapped axis does not
divide is replicated rather than refused (e.g. 10 classes over 8 devices), so every preset runs on
every layout.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from favor.config import blocks
from favor.config.checks import ConfigError, get, is_int

MESH_AXES = ("data", "fsdp", "sequence", "tensor")
# the models whose every layer works token by token or through favor.attention.sequence: what a
# sequence axis may split (the Conformer's convolution and ViT's class token would need their own)
SEQUENCE_MODELS = ("decoder", "bert")
BATCH_AXES = ("data", "fsdp")
DEFAULT_RULES = blocks.DEFAULT_RULES


def mesh_shape(spec: Mapping[str, int], num_devices: int) -> dict[str, int]:
    unknown = sorted(set(spec) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"unknown mesh axis {', '.join(map(repr, unknown))}; valid: {', '.join(MESH_AXES)}")
    sizes = {a: int(spec.get(a, 1)) for a in MESH_AXES}
    free = [a for a, n in sizes.items() if n == -1]
    if len(free) > 1 or any(n == 0 or n < -1 for n in sizes.values()):
        raise ValueError(f"mesh {dict(spec)}: sizes must be positive, with at most one -1 (the rest of the devices)")
    fixed = math.prod(n for n in sizes.values() if n != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh {dict(spec)} does not divide the {num_devices} devices "
                             f"(the fixed axes take {fixed})")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh {dict(spec)} has {math.prod(sizes.values())} devices but {num_devices} are "
                         f"available; the product of the mesh sizes must equal the device count (or use -1)")
    return sizes


def sequence_context(mesh):
    """The context in which a run's programs are built and traced: the attention layers see the mesh's
    sequence axis (favor.attention.sequence.over)."""
    from favor.attention import sequence
    return sequence.over(mesh)


def make_mesh(spec: Mapping[str, int], devices=None) -> jax.sharding.Mesh:
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(spec, len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def spec_for(logical: tuple, shape: tuple, mesh, rules: Mapping[str, Any]) -> P:
    """PartitionSpec of one parameter from its logical axis names."""
    out, used = [], set()
    for name, dim in zip(logical, shape):
        axis = rules.get(name) if name is not None else None
        if axis is None or axis in used or dim % mesh.shape[axis]:
            out.append(None)
        else:
            out.append(axis)
            used.add(axis)
    return P(*out)


def param_shardings(abstract_params, logical_tree, mesh, rules):
    """NamedShardings for a parameter tree, given the tree of logical axis tuples beside it."""
    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
    flat_axes = jax.tree.leaves(logical_tree, is_leaf=is_axes)
    flat, treedef = jax.tree.flatten(abstract_params)
    if len(flat_axes) != len(flat):
        raise ValueError("logical axes do not match the parameter tree")
    return treedef.unflatten([NamedSharding(mesh, spec_for(a, p.shape, mesh, rules))
                              for a, p in zip(flat_axes, flat)])


def like_params(tree, abstract_params, param_shardings, default):
    """Shardings for an optimizer state: a leaf whose key path ends with a parameter's path and has its
    shape takes that parameter's sharding (Adam's moments, however deeply optax.multi_transform or
    masked nest them, MaskedNode standing where a parameter is frozen), every other leaf `default`."""
    flat = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
    by_path = {tuple(p): (tuple(a.shape), s) for (p, a), (_, s) in zip(flat(abstract_params), flat(param_shardings))}
    lengths = sorted({len(p) for p in by_path}, reverse=True)

    def pick(path, leaf):
        for n in lengths:
            found = by_path.get(tuple(path[-n:])) if len(path) >= n else None
            if found is not None and found[0] == tuple(getattr(leaf, "shape", ())):
                return found[1]
        return default
    return jax.tree_util.tree_map_with_path(pick, tree)


def replicated(mesh):
    return NamedSharding(mesh, P())


def batch_sharding(mesh):
    return NamedSharding(mesh, P(BATCH_AXES))


@functools.lru_cache(maxsize=64)      # read for every batch and key: one computation per mesh and length
def process_rows(mesh, length: int) -> slice:
    """The rows of a global batch of `length` that this process's devices hold under batch_sharding: an
    equal share per process while the batch axes span the processes, the same rows for the processes a
    sequence or tensor axis spans."""
    index = batch_sharding(mesh).addressable_devices_indices_map((length,))
    spans = {(s[0].start or 0, length if s[0].stop is None else s[0].stop) for s in index.values()}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if sum(b - a for a, b in spans) != hi - lo:
        raise ValueError(f"mesh {dict(mesh.shape)}: this process's devices hold rows that are not one block "
                         f"of the batch; order the mesh so that each process's batch rows are contiguous")
    return slice(lo, hi)


def global_batch(local: Mapping[str, np.ndarray], mesh, pad_hosts: bool = False) -> dict[str, jax.Array]:
    """Each process passes its own slice of the global batch; the result is one global array per key,
    sharded over the batch axes (the same code runs on one host and on many). `pad_hosts`: the source
    sizes batches from each host's own rows (speech buckets), so hosts are padded to a common shape
    (one all-gather, a sync point: only for such sources)."""
    sharding = batch_sharding(mesh)
    local = {k: np.asarray(v) for k, v in local.items()}
    if pad_hosts and jax.process_count() > 1:
        local = _pad_to_common_shape(local)
    return {k: jax.make_array_from_process_local_data(sharding, v, _global_shape(mesh, v)) for k, v in local.items()}


def _global_shape(mesh, local):
    """The global shape of a batch array of which this process holds `local` (its `process_rows`)."""
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    mine = process_rows(mesh, dp)                  # one row per batch shard: the shards this process holds
    return (local.shape[0] * dp // (mine.stop - mine.start), *local.shape[1:])


def _pad_to_common_shape(local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hosts may trim their rows to different widths (length buckets of speech or text chosen from the
    rows each host read); one small all-gather of the shapes pads every host to the widest, with zeros,
    which every source's padding mask reads as "not a token / frame"."""
    keys = sorted(local)
    dims = np.asarray([d for k in keys for d in local[k].shape[1:]] or [0], np.int32)
    widest = np.max(multihost_utils.process_allgather(dims), axis=0)
    out, i = {}, 0
    for k in keys:
        a = local[k]
        want = widest[i:i + a.ndim - 1]
        i += a.ndim - 1
        out[k] = np.pad(a, [(0, 0)] + [(0, int(w) - s) for w, s in zip(want, a.shape[1:])])
    return out


def check(config, accumulate: int = 1) -> None:
    """`config.mesh` (known axes, positive sizes or -1, a product the devices fill), `config.sharding_rules`
    (mesh axes or None) and the batch sizes the data-parallel devices and processes must divide (the
    per-device batch also by `accumulate` microbatches): ConfigError naming the first bad key."""
    mesh_spec = dict(config.mesh)
    for axis, n in mesh_spec.items():
        if axis not in MESH_AXES:
            raise ConfigError(f"mesh.{axis}", n, f"unknown mesh axis {axis!r}; valid: {', '.join(MESH_AXES)}")
        if not is_int(n) or (n < 1 and n != -1):
            raise ConfigError(f"mesh.{axis}", n, "must be a positive integer, or -1 for the devices the other "
                                                 "axes leave")
    try:
        sizes = mesh_shape(mesh_spec, jax.device_count())
    except ValueError as e:
        # name the axis when one alone departs from the default layout (the one the user set)
        named = [a for a, n in mesh_spec.items() if n not in (1, -1)]
        key, value = (f"mesh.{named[0]}", mesh_spec[named[0]]) if len(named) == 1 else ("mesh", mesh_spec)
        raise ConfigError(key, value, str(e)) from None
    for name, axis in dict(config.get("sharding_rules", {})).items():
        if axis is not None and axis not in MESH_AXES:
            raise ConfigError(f"sharding_rules.{name}", axis, f"must be a mesh axis ({', '.join(MESH_AXES)}) or None")
    if sizes["sequence"] > 1:
        n = sizes["sequence"]
        model = config.model.get("name")
        if model not in SEQUENCE_MODELS:
            raise ConfigError("mesh.sequence", n, f"the {model} model cannot split its sequence over devices; "
                                                  f"{' and '.join(SEQUENCE_MODELS)} can (or mesh.sequence=1)")
        length = config.data.get("max_length") if "data" in config else None
        if is_int(length) and length % n:
            raise ConfigError("mesh.sequence", n, f"must divide data.max_length = {length} (each device holds "
                                                  f"max_length / {n} tokens of every row)")
    dp, procs = sizes["data"] * sizes["fsdp"], jax.process_count()
    # processes that a sequence or tensor axis spans hold the same rows (process_rows): the batch is shared
    # among the processes only while there are at least as many data-parallel devices as processes
    shared = procs if 1 < procs <= dp else 1
    for key in ("batch_size", "eval_batch_size"):
        v = get(config, key)
        if not is_int(v) or v < 1 or v % dp or v % shared:
            procs_too = f" and by the {procs} processes" if shared > 1 else ""
            raise ConfigError(key, v, f"must be a positive integer divisible by the number of data-parallel "
                                      f"devices ({dp}){procs_too}")
    per_device = config.batch_size // dp
    if per_device % accumulate:       # each microbatch is split over the data-parallel devices too
        raise ConfigError("optim.accumulate_steps", accumulate, f"must divide the per-device batch "
                                                                f"(batch_size / {dp} devices = {per_device})")
