"""In-memory sources: a dict of equal-length arrays per split, batched deterministically.

Training order: the concatenation of per-epoch permutations (epoch e shuffled by (seed, e)); global
batch s is positions [s·B, (s+1)·B) of that stream. So the stream is a function of (seed, step):
restarting at step s continues exactly, and within an epoch no example is seen twice or skipped.
"""

from __future__ import annotations

from typing import Iterator

import jax
import numpy as np


class ArraySource:
    OPTIONS: dict = {}
    train: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]

    @property
    def num_train(self) -> int:
        return len(next(iter(self.train.values())))

    @property
    def num_eval(self) -> int:
        return len(next(iter(self.eval.values())))

    def _epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(self.num_train)

    def train_indices(self, batch_size: int, step: int, seed: int) -> np.ndarray:
        """Global row indices of training batch `step`."""
        n = self.num_train
        start = step * batch_size
        out, pos = [], start
        while len(out) < batch_size:
            epoch, offset = divmod(pos, n)
            take = min(batch_size - len(out), n - offset)
            out.extend(self._epoch_order(seed, epoch)[offset:offset + take])
            pos += take
        return np.asarray(out)

    @staticmethod
    def _local(rows: np.ndarray) -> np.ndarray:
        p, i = jax.process_count(), jax.process_index()
        per = len(rows) // p
        return rows[i * per:(i + 1) * per]

    def select(self, arrays: dict, global_rows: np.ndarray, local_rows: np.ndarray) -> dict:
        """This host's rows of one global batch. Sources that reshape batches (e.g. trim padding to a
        bucket) decide from `global_rows`, so every host makes the same choice."""
        return {k: v[local_rows] for k, v in arrays.items()}

    def train_batches(self, batch_size: int, start_step: int = 0, seed: int = 0) -> Iterator[dict]:
        step = start_step
        while True:
            rows = self.train_indices(batch_size, step, seed)
            yield self.select(self.train, rows, self._local(rows))
            step += 1

    def eval_batches(self, batch_size: int) -> Iterator[dict]:
        n = self.num_eval
        for start in range(0, n, batch_size):
            rows = np.arange(start, start + batch_size)
            valid = rows < n
            rows = np.where(valid, rows, 0)
            batch = self.select(self.eval, rows, self._local(rows))
            batch["valid"] = self._local(valid)
            yield batch
