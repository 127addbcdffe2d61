"""Multi-query associative recall (MQAR; Arora, Eyuboglu et al. 2023, "Zoology"), the probe of how much a
sequence model can recall from its context: data name "mqar".

Each example, by Zoology's construction (restated):
- the vocabulary's lower half (without 0) holds keys, the upper half values; `num_pairs` distinct keys
  and `num_pairs` distinct values are drawn, and the sequence opens with k₁ v₁ k₂ v₂ … (2·num_pairs
  tokens);
- the rest of the sequence is a query region of (seq_len − 2·num_pairs) / 2 slots of two tokens; each
  key is asked once, in a slot drawn without replacement with probability ∝ slot^(power_a − 1) (a
  power law: most queries come soon after the context, as repeated bigrams do in text; power_a = 1 is
  uniform);
- the target at a query key's position is its value (the model predicts the token after it); every
  other position has none;
- with `random_non_queries`, the positions that are neither context nor query hold random tokens of
  the whole vocabulary instead of 0.

Examples are generated from (split, index) alone, so the data is fixed, random access and needs no
build step; train and eval are disjoint streams. Batch (as favor.data.text.CausalText's, for the
causal_lm task, whose accuracy is then MQAR's): input_ids, attention_mask, targets [B, L] int32 and
weights [B, L] float32 (1 at the num_pairs query positions).
"""

from __future__ import annotations

import numpy as np

from favor.data.source import IndexedSource

SPLIT_STREAMS = {"train": 0x3A11, "eval": 0xE7A1}


def example(rng, vocab_size: int, seq_len: int, num_pairs: int, power_a: float, random_non_queries: bool):
    """(input_ids [L], targets [L], weights [L]) of one example."""
    half = vocab_size // 2
    keys = rng.choice(np.arange(1, half), size=num_pairs, replace=False)
    values = rng.choice(np.arange(half, vocab_size), size=num_pairs, replace=False)
    context = 2 * num_pairs
    slots = (seq_len - context) // 2
    p = np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1.0)
    gaps = rng.choice(slots, size=num_pairs, replace=False, p=p / p.sum())
    ids = np.zeros(seq_len, np.int64)
    ids[0:context:2], ids[1:context:2] = keys, values
    at = context + 2 * gaps
    ids[at] = keys
    targets = np.zeros(seq_len, np.int64)
    weights = np.zeros(seq_len, np.float32)
    targets[at], weights[at] = values, 1.0
    if random_non_queries:
        free = ids == 0
        ids[free] = rng.integers(0, vocab_size, size=int(free.sum()))
    return ids, targets, weights


class Mqar(IndexedSource):
    OPTIONS = {"vocab_size": 8192, "seq_len": 64, "num_pairs": 8, "power_a": 0.01, "random_non_queries": True,
               "num_train": 100_000, "num_eval": 3_000}

    def __init__(self, vocab_size=8192, seq_len=64, num_pairs=8, power_a=0.01, random_non_queries=True,
                 num_train=100_000, num_eval=3_000):
        vocab_size, seq_len, num_pairs = int(vocab_size), int(seq_len), int(num_pairs)
        if seq_len % 2 or seq_len < 4:
            raise ValueError(f"mqar: seq_len must be even and at least 4; got {seq_len}")
        if num_pairs < 1 or 4 * num_pairs > seq_len:
            raise ValueError(f"mqar: num_pairs must be in [1, seq_len / 4 = {seq_len // 4}] (the context and a query "
                             f"slot of two tokens per pair); got {num_pairs}")
        if vocab_size // 2 - 1 < num_pairs or vocab_size <= seq_len:
            raise ValueError(f"mqar: vocab_size {vocab_size} must exceed seq_len {seq_len} and hold num_pairs "
                             f"distinct keys in its lower half")
        if not float(power_a) > 0:
            raise ValueError(f"mqar: power_a must be positive (1 = uniform query slots); got {power_a}")
        if int(num_train) < 1 or int(num_eval) < 1:
            raise ValueError(f"mqar: num_train and num_eval must be positive; got {num_train}, {num_eval}")
        self.vocab_size, self.seq_len, self.num_pairs = vocab_size, seq_len, num_pairs
        self.power_a, self.random_non_queries = float(power_a), bool(random_non_queries)
        self.sizes = {"train": int(num_train), "eval": int(num_eval)}

    def num_examples(self, split):
        return self.sizes[split]

    def read(self, split, global_rows, local_rows, rngs):
        b, length = len(local_rows), self.seq_len
        out = {"input_ids": np.zeros((b, length), np.int32), "attention_mask": np.ones((b, length), np.int32),
               "targets": np.zeros((b, length), np.int32), "weights": np.zeros((b, length), np.float32)}
        for i, row in enumerate(local_rows):
            rng = np.random.default_rng([SPLIT_STREAMS[split], int(row)])
            ids, targets, weights = example(rng, self.vocab_size, length, self.num_pairs, self.power_a,
                                            self.random_non_queries)
            out["input_ids"][i], out["targets"][i], out["weights"][i] = ids, targets, weights
        return out
