"""ListOps (Nangia & Bowman 2018) as Long Range Arena generates it: nested MAX, MIN, MED and SM (sum
mod 10) over the digits 0-9; the answer, a digit, is the class (10 classes). A TFDS dataset favor
generates (`favor_listops`, one builder config per length window, built on first use like the other
local corpora) and the data source `data.name = "listops"`.

The generator's rules, tokens and windows: favor.data.listops_trees.
"""

from __future__ import annotations

import numpy as np

from favor import extras
from favor.data import local
from favor.data.listops_trees import CLS, NUM_CLASSES, PAD, TOKEN_ID, VOCAB, WINDOWS, examples
from favor.data.source import IndexedSource, open_tfds, records, text

tfds = extras.tfds("the ListOps corpus (a TFDS builder)")


class FavorListops(tfds.core.GeneratorBasedBuilder):
    """ListOps by LRA's rules in favor's length windows."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "LRA's generator rules; operators, brackets and digits as tokens."}
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=name, description=f"{w.min_length} < length < {w.max_length}")
                       for name, w in WINDOWS.items()]

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"source": tfds.features.Text(),
                                                 "target": tfds.features.ClassLabel(num_classes=NUM_CLASSES)}),
            homepage="https://github.com/google-research/long-range-arena")

    def _split_generators(self, dl_manager):
        w = WINDOWS[self.builder_config.name]
        data = examples(w, seed=0)
        cuts = {"train": (0, w.num_train), "validation": (w.num_train, w.num_train + w.num_validation),
                "test": (w.num_train + w.num_validation, len(data))}
        return {split: self._generate_examples(data[a:b], split) for split, (a, b) in cuts.items()}

    def _generate_examples(self, data, split):
        for i, (source, target) in enumerate(data):
            yield f"{split}-{i}", {"source": source, "target": target}


class Listops(IndexedSource):
    """Batches {input_ids [B, L], token_type_ids, attention_mask, label} of a favor_listops window; rows
    padded to the window's longest ([CLS] + max_length − 1 tokens)."""

    OPTIONS = {"window": "512", "eval_split": "validation", "data_dir": None}

    def __init__(self, window="512", eval_split="validation", data_dir=None):
        if window not in WINDOWS:
            raise ValueError(f"listops: unknown window {window!r}; valid: {', '.join(WINDOWS)}")
        if eval_split not in ("validation", "test"):
            raise ValueError(f"listops: eval_split must be 'validation' or 'test'; got {eval_split!r}")
        name = f"{local.builder_name('listops')}/{window}"
        data_dir = local.prepare("listops", data_dir, window)
        self.sources = {"train": open_tfds(name, "train", data_dir), "eval": open_tfds(name, eval_split, data_dir)}
        self.length = WINDOWS[window].max_length      # [CLS] + at most max_length − 1 tokens
        self.vocab_size, self.num_classes = len(VOCAB), NUM_CLASSES

    def num_examples(self, split):
        return len(self.sources[split])

    def read(self, split, global_rows, local_rows, rngs):
        rows = records(self.sources[split], local_rows)
        ids = np.full((len(rows), self.length), PAD, np.int32)
        for i, r in enumerate(rows):
            seq = [CLS, *(TOKEN_ID[t] for t in text(r["source"]).split())]
            ids[i, :len(seq)] = seq
        return {"input_ids": ids, "token_type_ids": np.zeros_like(ids), "attention_mask": (ids != PAD).astype(np.int32),
                "label": np.asarray([int(r["target"]) for r in rows], np.int32)}
