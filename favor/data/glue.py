"""GLUE through the TFDS builders (`glue/<task>`), tokenized for BERT.

Each split is read once from the prepared TFDS dataset, tokenized ([CLS] a [SEP] b [SEP], token
types, longest-first truncation to `max_length`) and kept as arrays, so the training order is the
ArraySource stream (deterministic in (seed, step), resumable, per-host slices). Batches are trimmed to
the smallest of `buckets` that holds their longest example (a few compiled shapes instead of one
per length, padding kept small). Eval covers the whole validation split (MNLI: `validation_matched`
or `validation_mismatched`), padding rows marked invalid.
"""

from __future__ import annotations

import numpy as np

from favor import extras
from favor.config.checks import ConfigError
from favor.data import local, tokenizers
from favor.data.source import ArraySource, check_data_dir, open_tfds, records, text

FIELDS = {   # task -> (first text field, second or None, regression?)
    "cola": ("sentence", None, False), "sst2": ("sentence", None, False),
    "mrpc": ("sentence1", "sentence2", False), "qqp": ("question1", "question2", False),
    "stsb": ("sentence1", "sentence2", True), "mnli": ("premise", "hypothesis", False),
    "qnli": ("question", "sentence", False), "rte": ("sentence1", "sentence2", False),
    "wnli": ("sentence1", "sentence2", False),
    "docorder": ("sentence1", "sentence2", False),
}
# tasks favor generates (favor.data.local) instead of reading glue/<task>: task -> local corpus
LOCAL = {"docorder": "docorder"}
NUM_LABELS = {"mnli": 3, "stsb": 1}


def load_split(name: str, split: str, data_dir):
    """A prepared TFDS split as a dict of numpy arrays; a missing dataset says how to prepare it."""
    tfds = extras.tfds(f"the TFDS dataset {name!r}")    # TensorFlow loads only when data is read
    check_data_dir(name, data_dir)
    try:
        builder = tfds.builder(name, data_dir=data_dir)
        ds = builder.as_dataset(split=split)
    except (AssertionError, FileNotFoundError, ValueError, tfds.core.registered.DatasetNotFoundError) as e:
        where = data_dir or "~/tensorflow_datasets"
        raise FileNotFoundError(
            f"TFDS dataset {name} (split {split!r}) is not prepared in {where}: run `tfds build {name} "
            f"--data_dir {where}` on a machine with internet access and copy the directory here, or set "
            f"data.data_dir to where it is ({type(e).__name__}: {str(e)[:160]})") from e
    return _columns(list(tfds.as_numpy(ds)), name, split)


def load_local_split(name: str, split: str, data_dir):
    """A split of a corpus favor prepared (array_record, favor.data.local) as a dict of numpy arrays."""
    src = open_tfds(name, split, data_dir)
    return _columns(records(src, range(len(src))), name, split)


def _columns(rows: list, name: str, split: str) -> dict:
    if not rows:
        raise ValueError(f"{name} split {split!r} is empty")
    return {k: np.asarray([r[k] for r in rows]) for k in rows[0]}


class Glue(ArraySource):
    # no tokenizer is trained here: the ids must be those of the model's vocabulary, so the config names the
    # tokenizer or the model the run starts from brings it (favor.uptrain.options.check_tokenizer_given)
    NEEDS_TOKENIZER = True
    OPTIONS = {"task": "sst2", "tokenizer": "", "max_length": 128, "buckets": (32, 64, 128),
               "data_dir": None, "eval_split": "validation", "max_examples": 0}

    def __init__(self, task="sst2", tokenizer="", max_length=128, buckets=(32, 64, 128), data_dir=None,
                 eval_split="validation", max_examples=0):
        if task not in FIELDS:
            raise ValueError(f"unknown GLUE task {task!r}; valid: {', '.join(FIELDS)}")
        if task == "mnli" and eval_split == "validation":
            eval_split = "validation_matched"
        self.task, self.max_length = task, int(max_length)
        self.buckets = sorted({int(b) for b in buckets if int(b) <= self.max_length} | {self.max_length})
        self.regression = FIELDS[task][2]
        self.num_labels = NUM_LABELS.get(task, 2)
        if not tokenizer:
            # job.validate refuses a run with neither a tokenizer nor model.init_from; a run reaches this when its
            # source model brought none (a run that recorded none, a Hugging Face directory without vocab.txt)
            raise ConfigError("data.tokenizer", tokenizer, f"data.tokenizer is empty (and no model.init_from "
                              f"brought one): give {tokenizers.FORMS}, or start from a model that brings one "
                              "(run:<a favor run>: the tokenizer it recorded; hf:<a directory with vocab.txt>)")
        self.tokenizer = tokenizers.get(tokenizer)
        name, load = f"glue/{task}", load_split
        if task in LOCAL:             # built on first use into the local cache, like the other corpora
            data_dir = local.prepare(LOCAL[task], data_dir)
            name, load = local.builder_name(LOCAL[task]), load_local_split
        self.train = self._encode(load(name, "train", data_dir), max_examples)
        self.eval = self._encode(load(name, eval_split, data_dir), max_examples)

    def _encode(self, raw, max_examples):
        first, second, _ = FIELDS[self.task]
        n = len(raw[first]) if not max_examples else min(len(raw[first]), int(max_examples))
        strings = lambda f: [text(t) for t in raw[f][:n]]
        ids, types, mask = self.tokenizer.encode(strings(first), strings(second) if second else None,
                                                 self.max_length)
        label = raw["label"][:n].astype(np.float32 if self.regression else np.int32)
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "label": label}

    def select(self, arrays, global_rows, local_rows):
        """Trim the padding columns to the smallest bucket holding the global batch's longest row."""
        longest = int(arrays["attention_mask"][global_rows].sum(1).max())
        width = next(b for b in self.buckets if b >= longest)
        return {k: (v[local_rows][:, :width] if v.ndim == 2 else v[local_rows]) for k, v in arrays.items()}
