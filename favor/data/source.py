"""The one data-source interface: a split of N examples addressable by index, read in a stream that is
a pure function of (seed, step).

Training order is the concatenation of per-epoch permutations (epoch e shuffled by (seed, e)); global
batch s is positions [s·B, (s+1)·B) of that stream. So restarting at step s continues exactly where
the run stopped, and within an epoch no example is seen twice or skipped. Each process reads only its
rows [i·B/P, (i+1)·B/P) of every global batch.

Random augmentation (crops, SpecAugment, MLM masking) draws from a generator per example seeded by
(seed, step, position in the global batch): the same example at the same step gets the same
augmentation however many hosts share the batch, and a resumed run augments exactly as the first did.

Subclasses say how many examples each split has and how to read a list of them:

    num_examples(split) -> int                      split: "train" or "eval"
    read(split, global_rows, local_rows, rngs) -> dict of numpy arrays, one row per local row
                                                    (rngs: one np.random.Generator per local row on
                                                    "train", None on "eval")

Sources backed by TFDS open the prepared split with `open_tfds` (random access, the array_record
format), so this works the same for an in-memory array and for ImageNet on disk.
"""

from __future__ import annotations

import contextlib

import abc
from pathlib import Path
from typing import Iterator

import numpy as np

from favor import extras


# which rows of a global batch this process feeds, set once per process by the trainer from its mesh
# (favor.sharding.process_rows); None: an equal share per process. Process-wide like the device set itself,
# and read from the prefetch thread, which a context variable would not reach.
_PROCESS_ROWS = None


@contextlib.contextmanager
def process_rows(rows):
    """Within: rows(length) -> slice gives the rows of a global batch this process's devices hold (None:
    the default); the previous setting comes back after (a run's layout never outlives the run)."""
    global _PROCESS_ROWS
    before, _PROCESS_ROWS = _PROCESS_ROWS, rows
    try:
        yield
    finally:
        _PROCESS_ROWS = before


class IndexedSource(abc.ABC):
    OPTIONS: dict = {}
    host_dependent_shapes = False     # True: batch widths come from each host's own rows (the trainer pads)

    @abc.abstractmethod
    def num_examples(self, split: str) -> int:
        ...

    @abc.abstractmethod
    def read(self, split: str, global_rows: np.ndarray, local_rows: np.ndarray, rngs) -> dict:
        ...

    @property
    def num_train(self) -> int:
        return self.num_examples("train")

    @property
    def num_eval(self) -> int:
        return self.num_examples("eval")

    def _epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's permutation, cached: one O(N) shuffle per epoch, not per step (N is 8M packed
        Wikipedia rows)."""
        cached = getattr(self, "_order_cache", None)
        if cached is None or cached[0] != (seed, epoch):
            cached = ((seed, epoch), np.random.default_rng([seed, epoch]).permutation(self.num_train))
            self._order_cache = cached
        return cached[1]

    def train_indices(self, batch_size: int, step: int, seed: int) -> np.ndarray:
        """Global example indices of training batch `step`."""
        n = self.num_train
        if n == 0:
            raise ValueError(f"{type(self).__name__}: the training split is empty")
        out, pos = [], step * batch_size
        while len(out) < batch_size:
            epoch, offset = divmod(pos, n)
            take = min(batch_size - len(out), n - offset)
            out.extend(self._epoch_order(seed, epoch)[offset:offset + take])
            pos += take
        return np.asarray(out)

    @staticmethod
    def local_slice(length: int) -> slice:
        """This process's positions in a global batch of `length` rows: the rows its devices hold
        (`use_process_rows`: a mesh whose non-batch axes span processes gives several processes the
        same rows), by default an equal share per process."""
        if _PROCESS_ROWS is not None:
            return _PROCESS_ROWS(length)
        import jax        # here, not at the top: configs read data modules' constants without JAX
        p, i = jax.process_count(), jax.process_index()
        if length % p:
            raise ValueError(f"a global batch of {length} rows does not split over {p} processes")
        per = length // p
        return slice(i * per, (i + 1) * per)

    def train_batches(self, batch_size: int, start_step: int = 0, seed: int = 0) -> Iterator[dict]:
        step = start_step
        while True:
            rows = self.train_indices(batch_size, step, seed)
            mine = self.local_slice(len(rows))
            positions = np.arange(batch_size)[mine]
            rngs = [np.random.default_rng([seed, step, int(p), 0xDA7A]) for p in positions]
            yield self.read("train", rows, rows[mine], rngs)
            step += 1

    def eval_batches(self, batch_size: int) -> Iterator[dict]:
        """The whole eval split once; the short last batch is padded with copies of row 0 and
        batch["valid"] marks the real rows."""
        n = self.num_eval
        for start in range(0, n, batch_size):
            rows = np.arange(start, start + batch_size)
            valid = rows < n
            rows = np.where(valid, rows, 0)
            mine = self.local_slice(len(rows))
            batch = self.read("eval", rows, rows[mine], None)
            batch["valid"] = valid[mine]
            yield batch


class ArraySource(IndexedSource):
    """In-memory splits: `self.train` and `self.eval` are dicts of equal-length numpy arrays."""

    train: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]

    def num_examples(self, split):
        return len(next(iter(getattr(self, split).values())))

    def read(self, split, global_rows, local_rows, rngs):
        return self.select(getattr(self, split), global_rows, local_rows)

    def select(self, arrays: dict, global_rows: np.ndarray, local_rows: np.ndarray) -> dict:
        """This host's rows of one global batch. Sources that reshape batches (e.g. trim padding to a
        bucket) decide from `global_rows`, so every host makes the same choice."""
        return {k: v[local_rows] for k, v in arrays.items()}


def open_tfds(name: str, split: str, data_dir=None):
    """A prepared TFDS split with random access (`builder.as_data_source`); a dataset that is not
    prepared, or prepared without the array_record format, is an error that says what to do."""
    tfds = extras.tfds(f"the TFDS dataset {name!r}")    # TensorFlow loads only when data is read
    where = data_dir or "~/tensorflow_datasets"
    check_data_dir(name, data_dir, "--file_format=array_record")
    try:
        builder = tfds.builder(name, data_dir=data_dir)
        source = builder.as_data_source(split=split)
    except (AssertionError, FileNotFoundError, ValueError, NotImplementedError,
            tfds.core.registered.DatasetNotFoundError) as e:
        raise FileNotFoundError(
            f"TFDS dataset {name} (split {split!r}) is not prepared in {where} with random access: run "
            f"`tfds build {name} --data_dir {where} --file_format=array_record` (on a machine with internet "
            f"access, then copy the directory here), or set data.data_dir to where it is "
            f"({type(e).__name__}: {str(e)[:200]})") from e
    if len(source) == 0:
        raise ValueError(f"TFDS dataset {name} split {split!r} in {where} is empty")
    return source


def check_data_dir(name: str, data_dir, build_flags: str = ""):
    """A data_dir that does not exist is a mistake in the config, not a dataset to download."""
    if data_dir is not None:
        if not Path(data_dir).expanduser().exists():
            raise FileNotFoundError(f"data_dir {data_dir} does not exist (for TFDS dataset {name}); create it and "
                                    f"prepare the dataset there with `tfds build {name} --data_dir {data_dir}"
                                    f"{' ' + build_flags if build_flags else ''}`, or set data.data_dir to where it is")


def records(src, rows) -> list:
    """Records `rows` of a TFDS data source, read in one batched call where the source supports it
    (array_record reads them in parallel); TFDS's mock data source only reads one at a time."""
    rows = [int(r) for r in rows]
    try:
        return list(src.__getitems__(rows))
    except (TypeError, AttributeError):
        return [src[r] for r in rows]


def text(value) -> str:
    """A TFDS text feature as str (prepared datasets give bytes, some mocks give str)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
