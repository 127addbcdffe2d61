"""Checkpoints with orbax: async saves, keep K, restore the newest checkpoint that is whole.

orbax writes each step into a temporary directory and renames it when every file is on disk, so a
process killed mid-write leaves no step that `all_steps()` lists. A step that is listed but damaged
afterwards (a truncated or deleted file, a flipped byte) must still never be restored: each save
records a fingerprint of the state (per-leaf sums, computed on device) beside it, and a restore that
fails or does not reproduce the fingerprint is skipped with a warning and renamed `<step>.damaged-N`
(kept for inspection, never listed again), falling back to the previous step.
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

log = logging.getLogger(__name__)


class _ItemMetadataNoise(logging.Filter):
    """orbax's composite restore asks each item's directory (<step>/state, <step>/meta) for the step metadata
    file that only <step>/ itself holds, and warns "Metadata file does not exist" for every item of every
    restore, a tool's included. The restore does not need it (the fingerprint checks what was read), so
    that one warning about an item directory is dropped; the same message about a step directory stays."""

    def filter(self, record: logging.LogRecord) -> bool:
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


@jax.jit
def fingerprint(state):
    return [jnp.sum(jnp.abs(x.astype(jnp.float32))) + jnp.sum(x.astype(jnp.float32))
            for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.number)]


def _leaves_ok(a, b):
    return len(a) == len(b) and bool(np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                                 rtol=1e-5, atol=1e-6))


class Checkpointer:
    def __init__(self, directory, keep: int = 3, asynchronous: bool = True):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                                 enable_async_checkpointing=asynchronous))

    restored_meta: dict | None = None    # the metadata of the step restore_latest returned

    def steps(self):
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict):
        """Starts an async save of `state` (a pytree of arrays) with a JSON `meta` beside it."""
        meta = dict(meta, fingerprint=[float(x) for x in jax.device_get(fingerprint(state))])
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self):
        self.manager.wait_until_finished()

    def restore_latest(self, abstract_state):
        """(state, meta, step) of the newest whole checkpoint, or None when there is none."""
        _quiet_late_reads()    # before the first read: a failed one's stragglers may end at any time
        for step in reversed(self.steps()):
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
        rerun may save that step number again."""
        src = self.directory / str(step)
        n = 0
        while (self.directory / f"{step}.damaged-{n}").exists():
            n += 1
        if jax.process_index() == 0 and src.exists():
            src.rename(self.directory / f"{step}.damaged-{n}")
        self.manager.reload()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()
