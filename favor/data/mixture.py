"""A second source mixed into a run's training batches: the data block's `mix_in` (a block of its own) and
`mix_rate` (the share of every training batch it fills).

    config.data.mix_in = {"name": "mqar", "vocab_size": 256, "seq_len": 128, "num_pairs": 8}
    config.data.mix_rate = 0.25

What this is for: a language model that should also learn a skill its corpus rarely teaches (associative
recall, copying), the way pretraining mixtures add synthetic or task data. Every training batch holds
round(mix_rate · B) rows of the mixed-in source at fixed, evenly spread positions and the main source's rows
elsewhere, so each batch has the same share (a per-row coin would make the share of a small batch noisy)
and every host's slice holds its share of both. Each source keeps its own epoch order, so neither repeats
or skips rows because of the other, and a resumed run continues both exactly. Evaluation reads the main
source alone: a run's validation metric stays the one its main data defines, and the mixed-in skill is
measured on that source's own eval split (favor.repro.linearize's recall does).

Both sources must give batches of the same keys and shapes (a causal_text block and an mqar block of the
same length do): a mismatch is an error naming both. One exception: where the main source packs
documents (`segment_ids` and `positions`) and the mixed-in one has neither, each of its rows is one
document (ids 0, positions 0 … L − 1), which is what a source without those keys means.
"""

from __future__ import annotations

import numpy as np

from favor.data.source import IndexedSource

DOCUMENT_KEYS = ("segment_ids", "positions")
MIX_STREAM = 0x5EC0        # the mixed-in source's order is drawn from (seed, this), apart from the main one's


def mixed_positions(batch_size: int, rate: float) -> np.ndarray:
    """The positions of a global batch the mixed-in source fills: round(rate · B), evenly spread."""
    n = int(round(rate * batch_size))
    return np.floor(np.arange(n) * batch_size / n).astype(int) if n else np.zeros(0, int)


class Mixture(IndexedSource):
    host_dependent_shapes = False

    def __init__(self, main: IndexedSource, extra: IndexedSource, rate: float, names=("main", "mix_in")):
        self.main, self.extra, self.rate, self.names = main, extra, float(rate), names
        for source, name in ((main, names[0]), (extra, names[1])):
            if source.host_dependent_shapes:
                raise ValueError(f"data.mix_in: {name} gives batches whose widths depend on the rows read; a "
                                 f"mixture needs two fixed-width sources")
        # every host checks the same first rows, so all of them agree on a mismatch (a per-batch check
        # would fire only on the hosts whose slice holds rows of both)
        first = lambda s: s.read("train", np.zeros(1, int), np.zeros(1, int), [np.random.default_rng(0)])
        head = first(main)
        self.documents = all(k in head for k in DOCUMENT_KEYS)
        _check_alike([(names[0], head), (names[1], self._extra_rows(first(extra)))])

    def _extra_rows(self, batch):
        """The mixed-in rows, each one document where the main source packs documents and this one has no
        document keys."""
        if not self.documents or any(k in batch for k in DOCUMENT_KEYS):
            return batch
        b, length = batch["input_ids"].shape
        return {**batch, "segment_ids": np.zeros((b, length), np.int32),
                "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy()}

    @property
    def tokenizer(self):
        return getattr(self.main, "tokenizer", None)

    @property
    def vocab_size(self):
        """The embedding must hold both sources' ids."""
        sizes = [getattr(s, "vocab_size", None) for s in (self.main, self.extra)]
        sizes = [int(s) for s in sizes if s is not None]
        return max(sizes) if sizes else None

    def num_examples(self, split):
        return self.main.num_examples(split)

    def read(self, split, global_rows, local_rows, rngs):
        # evaluation (and any direct read) is the main source's
        return self.main.read(split, global_rows, local_rows, rngs)

    def train_batches(self, batch_size: int, start_step: int = 0, seed: int = 0):
        mixed = np.zeros(batch_size, bool)
        mixed[mixed_positions(batch_size, self.rate)] = True
        n_mix = int(mixed.sum())
        if n_mix == 0:
            raise ValueError(f"data.mix_rate={self.rate}: mixes no row into a batch of {batch_size} (round(rate · B) "
                             f"= 0); give at least {0.5 / batch_size + 1e-9:.3g}")
        if n_mix == batch_size:
            raise ValueError(f"data.mix_rate={self.rate}: fills all {batch_size} rows of a batch; the main source "
                             f"needs at least one (mix_rate < {1 - 0.5 / batch_size:.3f})")
        mine = np.arange(batch_size)[self.local_slice(batch_size)]
        step = start_step
        while True:
            rows = np.empty(batch_size, np.int64)
            rows[~mixed] = self.main.train_indices(batch_size - n_mix, step, seed)
            rows[mixed] = self.extra.train_indices(n_mix, step, seed ^ MIX_STREAM)
            rngs = [np.random.default_rng([seed, step, int(p), 0xDA7A]) for p in mine]
            parts = []
            for source, which, name in ((self.main, ~mixed, self.names[0]), (self.extra, mixed, self.names[1])):
                take = np.flatnonzero(which[mine])
                if len(take):
                    batch = source.read("train", rows[which], rows[mine][take], [rngs[i] for i in take])
                    parts.append((take, name, batch if source is self.main else self._extra_rows(batch)))
            yield _assemble(parts, len(mine))
            step += 1


def _check_alike(parts) -> None:
    """[(name, batch)]: every batch has the first's keys, row shapes and dtypes, else a ValueError naming both."""
    (first_name, first), *rest = parts
    want = {k: (v.shape[1:], v.dtype.name) for k, v in first.items()}
    for name, batch in rest:
        got = {k: (v.shape[1:], v.dtype.name) for k, v in batch.items()}
        if got != want:
            raise ValueError(f"data.mix_in: its batches ({name}: {got}) do not match the main source's "
                             f"({first_name}: {want}); give it the same row length, batch keys and dtypes")


def _assemble(parts, size: int) -> dict:
    """One batch of `size` rows from [(positions, name, batch)], whose keys, row shapes and dtypes agree."""
    _check_alike([(name, batch) for _, name, batch in parts])
    first = parts[0][2]
    out = {k: np.empty((size, *v.shape[1:]), v.dtype) for k, v in first.items()}
    for positions, _, batch in parts:
        for k, v in batch.items():
            out[k][positions] = v
    return out
