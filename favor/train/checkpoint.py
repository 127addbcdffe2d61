"""Checkpoints with orbax: async saves, keep K, restore the newest checkpoint that is whole.

orbax writes each step into a temporary directory and renames it when every file is on disk, so a
process killed mid-write leaves no step that `all_steps()` lists. A step that is listed but damaged
afterwards (a truncated or deleted file, a flipped byte) must still never be restored: each save
records a fingerprint of the state (per-leaf sums, computed on device) beside it, and a restore that
fails or does not reproduce the fingerprint is skipped with a warning and renamed `<step>.damaged-N`
(kept for inspection, never listed again), falling back to the previous step.

A step that reads fine but holds another tree or other shapes than the model's is not damaged: it is
another model's run, and restoring it is refused (`Mismatch`) before anything is read, renamed or
deleted. The directory is made by the first save, not before: a start that fails leaves none.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from favor.config.checks import UsageError

log = logging.getLogger(__name__)


# what orbax says of every read-only manager (a reader's: no saves, no pruning, no directory made), which
# is what read_only asks for
READ_ONLY_NOTES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")


class _ItemMetadataNoise(logging.Filter):
    """orbax's composite restore asks each item's directory (<step>/state, <step>/meta) for the step metadata
    file that only <step>/ itself holds, and warns "Metadata file does not exist" for every item of every
    restore, a tool's included. The restore does not need it (the fingerprint checks what was read), so
    that one warning about an item directory is dropped; the same message about a step directory stays.
    So are orbax's notes on every read-only manager (READ_ONLY_NOTES): a reader asked for exactly that."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(READ_ONLY_NOTES):
            return False
        if not str(record.msg).startswith("Metadata file does not exist"):
            return True
        path = Path(str(record.args[0] if record.args else ""))
        return path.parent.name not in ("state", "meta")


ITEM_METADATA_FILTER = _ItemMetadataNoise()
logging.getLogger("absl").addFilter(ITEM_METADATA_FILTER)


def _late_read_noise(unraisable) -> bool:
    """Whether an unraisable exception is a tensorstore read finishing after orbax closed its loop.

    orbax runs a restore's reads on a fresh event loop and closes it as soon as one read fails; the
    other reads of a damaged step are still in flight in tensorstore's threads, and each one that ends
    afterwards fails to hand its result to the closed loop: dozens of "Exception ignored ... Event loop
    is closed" tracebacks on stderr, later and from no frame of ours (the object is None). They are
    results nobody waits for, so exactly those are dropped; every other unraisable reaches the hook."""
    e = unraisable.exc_value
    return unraisable.object is None and isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def _quiet_late_reads():
    """Puts the filter in front of whatever unraisable hook is installed now (once per hook)."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_late_reads", False):
        return

    def hook(unraisable):
        if not _late_read_noise(unraisable):
            previous(unraisable)
    hook.drops_late_reads = True
    sys.unraisablehook = hook


class Mismatch(UsageError):
    """A checkpoint whose tree or shapes are not the model's: a run of another configuration."""


def dotted(path) -> str:
    """'layers.0.attention.query.kernel' for a pytree key path (an nnx.State's or a checkpoint's tree,
    where every Variable is saved as {'value': array})."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    if parts and parts[-1] == "value":
        parts = parts[:-1]
    return ".".join(parts)


def _saved_shape(leaf) -> tuple:
    # a typed PRNG key is saved as its raw key data: the key's shape and then the key's own, (2,) for threefry
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
    return tuple(leaf.shape)


def shapes(tree) -> dict:
    """{dotted path: shape as saved} of a tree of arrays, ShapeDtypeStructs or orbax's array metadata."""
    return {dotted(p): _saved_shape(leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def mismatch(saved: dict, wanted: dict, most: int = 3) -> str:
    """How a checkpoint's {path: shape} differs from the model's, in words ("" when it does not)."""
    order = lambda paths: sorted(paths, key=lambda p: (not p.startswith("params."), p))   # parameters first
    out = [f"{p} is not in the checkpoint" for p in order(set(wanted) - set(saved))]
    out += [f"{p} is in the checkpoint but not in the model" for p in order(set(saved) - set(wanted))]
    out += [f"{p} has shape {saved[p]} in the checkpoint, {wanted[p]} in the model"
            for p in order(set(saved) & set(wanted)) if saved[p] != wanted[p]]
    more = f" and {len(out) - most} more differences" if len(out) > most else ""
    return "; ".join(out[:most]) + more


@jax.jit
def fingerprint(state):
    return [jnp.sum(jnp.abs(x.astype(jnp.float32))) + jnp.sum(x.astype(jnp.float32))
            for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.number)]


def _leaves_ok(a, b):
    return len(a) == len(b) and bool(np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                                 rtol=1e-5, atol=1e-6))


class Checkpointer:
    """`read_only`: a tool's reader, which neither saves nor sets a damaged step aside."""

    def __init__(self, directory, keep: int = 3, asynchronous: bool = True, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        self._options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=asynchronous,
                                                     read_only=read_only)
        self._manager = None

    restored_meta: dict | None = None    # the metadata of the step restore_latest returned

    @property
    def manager(self) -> ocp.CheckpointManager:
        # made on first use: orbax creates a missing directory, which only a save may do
        if self._manager is None:
            self._manager = ocp.CheckpointManager(self.directory, options=self._options)
        return self._manager

    def steps(self):
        return sorted(self.manager.all_steps()) if self.directory.is_dir() else []

    def saved_shapes(self, step: int) -> dict:
        """{dotted path: shape} of the state saved at `step`, from its metadata (no array is read)."""
        tree = ocp.StandardCheckpointer().metadata(self.directory / str(step) / "state").item_metadata
        saved = shapes(getattr(tree, "tree", tree))
        if not saved:    # orbax warns and returns no tree when the metadata does not read
            raise ValueError(f"the metadata of checkpoint {step} in {self.directory} does not read")
        return saved

    def save(self, step: int, state, meta: dict):
        """Starts an async save of `state` (a pytree of arrays) with a JSON `meta` beside it."""
        meta = dict(meta, fingerprint=[float(x) for x in jax.device_get(fingerprint(state))])
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self):
        if self._manager is not None:
            self._manager.wait_until_finished()

    def restore_latest(self, abstract_state):
        """(state, meta, step) of the newest whole checkpoint, or None when there is none. A step whose
        tree or shapes differ from `abstract_state`'s is a `Mismatch` error, not a damaged step."""
        _quiet_late_reads()    # before the first read: a failed one's stragglers may end at any time
        wanted = shapes(abstract_state)
        for step in reversed(self.steps()):
            try:
                differs = mismatch(self.saved_shapes(step), wanted)
            except Exception:    # unreadable metadata: damage, which the restore below reports
                differs = ""
            if differs:
                raise Mismatch(f"checkpoint {step} in {self.directory} does not fit this model: {differs}. It is a "
                               f"run of another configuration; train in another --workdir, or start from it with "
                               f"--config.model.init_from=run:{self.directory.parent}")
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
                state, meta = out["state"], dict(out["meta"])
                if not _leaves_ok(jax.device_get(fingerprint(state)), meta.get("fingerprint", [])):
                    raise ValueError("its contents do not match the fingerprint saved with it")
            except Exception as e:   # any damage: skip this step, never load part of it
                msg = f"checkpoint step {step} in {self.directory} is unreadable or damaged ({type(e).__name__}: " \
                      f"{str(e)[:200]}); trying the previous one"
                warnings.warn(msg, stacklevel=2)
                log.warning(msg)
                self._set_aside(step)
                continue
            self.restored_meta = meta
            return state, meta, step
        return None

    def _set_aside(self, step):
        """Rename a damaged step to <step>.damaged-N: kept for inspection, no longer a step, and the
        rerun may save that step number again. A reader leaves it where it is."""
        if self.read_only:
            return
        src = self.directory / str(step)
        n = 0
        while (self.directory / f"{step}.damaged-{n}").exists():
            n += 1
        if jax.process_index() == 0 and src.exists():
            src.rename(self.directory / f"{step}.damaged-{n}")
        self.manager.reload()

    def close(self):
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
