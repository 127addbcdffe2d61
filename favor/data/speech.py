"""Speech recognition data: TFDS `librispeech` or favor's espeak-ng corpus, as log-mel frames and
sentencepiece labels for CTC.

    data = {"name": "speech", "dataset": "librispeech" | "local" | "local:<config>",
            "train_split": "train_clean100+train_clean360+train_other500", "eval_split": "dev_clean",
            "vocab_size": 256, "max_frames": 2048, "buckets": (...), "spec_augment": True, ...}

Batches (host-local rows):
    features       [B, T, 80] float32  normalised log-mel (favor.data.audio), 0 past the length
    feature_lengths [B] int32          valid frames
    labels         [B, U] int32        sentencepiece ids (1..vocab−1; 0 = pad, never a label), 0-padded
    label_lengths  [B] int32
    valid          [B] bool            train: False for a row left out (too long); eval: from the base class

Decisions:
* Reading: both splits by random access (`open_tfds`, array_record); features are computed per batch
  (small beside the model step: BENCHMARKS.md, design-measurements), nothing is cached.
* Features: 80 log-mel bins, 25 ms / 10 ms (favor.data.audio), normalised per utterance and bin (no
  dataset statistic to estimate or ship; removes the channel offset of each recording or voice).
* `max_frames` (train only): a longer utterance is dropped, not trimmed: cutting the audio would
  leave words in the transcript that the features no longer contain. A dropped row stays in the batch
  (shapes and the resumable stream are unchanged) with valid = False, no labels and its first frames
  (never an all-padding row: a batch without one valid frame gives the masked BatchNorm no statistics),
  so it adds nothing to the loss. The default 2048 frames (20.5 s) is at most 511 encoder frames after
  the 4× subsampling: CRT Table 6's 512 tokens. Evaluation keeps every utterance. Clips under 7 frames
  (70 ms) are padded to 7 with mean frames, the least the Conformer's subsampling takes.
* Buckets: each batch is padded to the smallest of `buckets` holding its longest row (in evaluation,
  beyond the largest bucket, to a multiple of the smallest), and its labels to that bucket's encoder
  frames (the most labels CTC can align there; a longer transcript drops the row in training), so a
  run compiles one shape per bucket used. The width is decided from this host's rows;
  favor.sharding.global_batch pads hosts to a common width (zeros: no frames, no labels).
* Labels: sentencepiece. With `tokenizer` empty, one is trained on first use (unigram, at most
  `vocab_size` pieces: 0 = pad, 1 = unk, 2-4 = [CLS] [SEP] [MASK], never produced from text) on the
  training transcripts (LibriSpeech: 20,000 utterances drawn with a fixed seed, audio not decoded) and
  cached as <data_dir>/favor_tokenizers/<builder>-<split>-n<examples>-v<vocab_size>.model. The CTC
  task decodes with the same model: `task.tokenizer`, or when that is empty the data source's (the
  trainer binds the task to the source).
* SpecAugment (train, `spec_augment`): favor.data.audio.LIBRISPEECH, drawn from the per-example rng the
  base class passes (the same masks at the same step on any number of hosts and after a resume).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from favor import extras
from favor.data import audio, local, tokenizers
from favor.data.source import IndexedSource, open_tfds

DATASETS = {"librispeech": "librispeech", "local": "favor_speech"}
TOKENIZER_SAMPLE = 20_000       # training transcripts read to train the tokenizer

# The Conformer's 4× convolutional subsampling (two VALID 3-wide stride-2 convolutions), which the
# buckets and label widths are sized by. Stated here so that data does not import models;
# favor.models.conformer keeps its own copy for the model, and a test checks that the two agree.
MIN_FRAMES = 7                  # the fewest frames that give one encoder frame


def subsampled_length(frames):
    """Encoder frames after the subsampling (int or numpy array; 0 below MIN_FRAMES)."""
    for _ in range(2):
        frames = np.maximum((frames - 3) // 2 + 1, 0)
    return frames


def _text(value) -> str:
    """A TFDS text feature as str: bytes, str, or a 0-d array of either (SkipDecoding gives arrays)."""
    if isinstance(value, np.ndarray):
        value = value.item()
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _transcript(value) -> str:
    return " ".join(_text(value).split())


def _builder(dataset: str, data_dir):
    """(TFDS builder name, data_dir) of `dataset`: "librispeech", "local" or "local:<config>" (the espeak
    corpus, built in the cache or `data_dir` on first use)."""
    kind, _, config = str(dataset).partition(":")
    if kind not in DATASETS or (config and kind != "local"):
        raise ValueError(f"unknown speech dataset {dataset!r}; valid: 'librispeech', 'local', 'local:<config>' "
                         f"(the espeak corpus favor_speech, e.g. 'local:tiny')")
    if kind == "librispeech":
        return DATASETS[kind], data_dir
    name = local.builder_name("speech")
    return (f"{name}/{config}" if config else name), local.prepare("speech", data_dir, config or None)


class Speech(IndexedSource):
    host_dependent_shapes = True       # buckets from this host's rows: hosts are padded to a common width
    OPTIONS = {"dataset": "librispeech", "train_split": "train_clean100+train_clean360+train_other500",
               "eval_split": "dev_clean", "data_dir": None, "tokenizer": "", "vocab_size": 256,
               "max_frames": 2048, "buckets": (256, 512, 1024, 1536, 2048), "spec_augment": True}

    def __init__(self, dataset="librispeech", train_split="train_clean100+train_clean360+train_other500",
                 eval_split="dev_clean", data_dir=None, tokenizer="", vocab_size=256, max_frames=2048,
                 buckets=(256, 512, 1024, 1536, 2048), spec_augment=True):
        self.max_frames, self.vocab_size = int(max_frames), int(vocab_size)
        if self.max_frames < MIN_FRAMES:
            raise ValueError(f"speech: max_frames {max_frames} is below the Conformer's minimum of {MIN_FRAMES}")
        if self.vocab_size < 8:
            raise ValueError(f"speech: vocab_size {vocab_size} is too small (ids 0-4 are pad, unk and the BERT "
                             f"symbols); use ≥ 8")
        buckets = tuple(int(b) for b in buckets)
        if any(b < MIN_FRAMES for b in buckets):
            raise ValueError(f"speech: buckets {buckets} must each be ≥ {MIN_FRAMES} frames")
        self.buckets = sorted({b for b in buckets if b <= self.max_frames} | {self.max_frames})
        self.spec_augment = bool(spec_augment)
        self.dataset, self.train_split = dataset, train_split
        name, data_dir = _builder(dataset, data_dir)
        self.sources = {"train": open_tfds(name, train_split, data_dir), "eval": open_tfds(name, eval_split, data_dir)}
        self.tokenizer_file = Path(tokenizer) if tokenizer else self._trained_tokenizer(name, data_dir)
        self.tokenizer = tokenizers.SentencePiece(self.tokenizer_file)
        if self.tokenizer.vocab_size > self.vocab_size:
            raise ValueError(f"speech: tokenizer {self.tokenizer_file} has {self.tokenizer.vocab_size} pieces but "
                             f"data.vocab_size is {self.vocab_size}; set data.vocab_size and model.vocab_size "
                             f"to ≥ {self.tokenizer.vocab_size}")

    # -- tokenizer -----------------------------------------------------------------------------------
    def _trained_tokenizer(self, name, data_dir) -> Path:
        n = len(self.sources["train"])
        root = Path(data_dir).expanduser() if data_dir else Path("~/tensorflow_datasets").expanduser()
        slug = re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{name}-{self.train_split}")
        path = root / "favor_tokenizers" / f"{slug}-n{n}-v{self.vocab_size}.model"
        if path.exists():
            return path
        tfds = extras.tfds(f"the TFDS dataset {name!r}")    # TensorFlow loads only when data is read
        # the transcripts only: the audio is left encoded (LibriSpeech's FLAC is never decoded here)
        texts_source = tfds.builder(name, data_dir=data_dir).as_data_source(
            split=self.train_split, decoders={"speech": tfds.decode.SkipDecoding()})
        rows = range(n) if n <= TOKENIZER_SAMPLE else \
            np.sort(np.random.default_rng(0).choice(n, TOKENIZER_SAMPLE, replace=False))
        texts = [_transcript(texts_source[int(i)]["text"]) for i in rows]
        tokenizers.train_sentencepiece(texts, path, self.vocab_size)     # atomic: hosts may race here
        return path

    # -- IndexedSource -------------------------------------------------------------------------------
    def num_examples(self, split):
        return len(self.sources[split])

    def _width(self, longest: int, train: bool) -> int:
        for b in self.buckets:
            if b >= longest:
                return b
        if train:
            raise AssertionError("rows longer than max_frames are dropped before bucketing")
        step = self.buckets[0]
        return -(-longest // step) * step

    @staticmethod
    def _label_width(width: int, longest: int, train: bool) -> int:
        """One label width per frame bucket: the encoder frames of that bucket, the most labels CTC can
        align there (so a run compiles one shape per bucket). In evaluation a longer label (which no
        hypothesis can match, but the reference must be whole) widens it to the next power of two."""
        frames = int(subsampled_length(width))
        if train or longest <= frames:
            return frames
        return 1 << (longest - 1).bit_length()

    def read(self, split, global_rows, local_rows, rngs):
        train = split == "train"
        examples = [self.sources[split][int(i)] for i in local_rows]
        feats, lengths = audio.log_mel([np.asarray(e["speech"]).reshape(-1) for e in examples])
        feats = audio.normalize(feats, lengths)
        feats = np.pad(feats, ((0, 0), (0, max(MIN_FRAMES - feats.shape[1], 0)), (0, 0)))
        labels = self.tokenizer.ids([_transcript(e["text"]) for e in examples])
        lengths = np.maximum(lengths, MIN_FRAMES)      # < 70 ms: padded with mean (0) frames, counted as valid
        keep = lengths <= self.max_frames if train else np.ones(len(examples), bool)
        label_lengths = np.asarray([len(ids) if k else 0 for ids, k in zip(labels, keep)], np.int32)
        width = self._width(int(lengths[keep].max(initial=MIN_FRAMES)), train)
        lengths = np.minimum(lengths, width).astype(np.int32)   # dropped rows: their first `width` frames
        label_width = self._label_width(width, int(label_lengths.max(initial=0)), train)
        if train:   # labels longer than the encoder frames can never be aligned: dropped with the row
            long = label_lengths > label_width
            keep, label_lengths = keep & ~long, np.where(long, 0, label_lengths).astype(np.int32)
        features = np.zeros((len(examples), width, feats.shape[-1]), np.float32)
        out_labels = np.zeros((len(examples), label_width), np.int32)
        for j in range(len(examples)):
            n, u = int(lengths[j]), int(label_lengths[j])
            x = feats[j, :n]
            if train and self.spec_augment and keep[j]:
                x = audio.spec_augment(x, rngs[j])
            features[j, :n] = x
            out_labels[j, :u] = labels[j][:u]
        batch = {"features": features, "feature_lengths": lengths, "labels": out_labels,
                 "label_lengths": label_lengths}
        if train:
            batch["valid"] = keep
        return batch
