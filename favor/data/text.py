"""Text for language models: a TFDS text builder, tokenized and packed; masked as BERT does (MaskedText,
data name "text") or read for next-token prediction (CausalText, "causal_text").

    data = {"name": "text", "dataset": "wikipedia/20230601.en", "tokenizer": "", "max_length": 512, ...}

Pipeline
- Corpus: any TFDS builder with a text feature (`wikipedia/...`, `c4/en`, ...), read with random access;
  `dataset="local"` is favor's own offline corpus (`favor_docstrings`: the standard library's
  docstrings, built into the cache on first use); `dataset="files:<path>"` the user's own plain-text or
  JSONL files (favor.data.files).
- Tokenizer: a given spec (`sentencepiece:<model>`, or `wordpiece:<vocab.txt>` to uptrain a Hugging Face
  BERT with its own vocabulary), or, when empty, a sentencepiece model that favor trains on a seeded
  sample of `tokenizer_sample` training documents, cached as
  `<cache>/favor_tokenizers/<dataset>-<vocab>-<hash of field, split, sample, vocab>.model`
  (the same command as `python -m favor.data.text tokenizer ...`).
- Packing: each split is tokenized once into one flat token array (documents separated by [SEP]),
  cached as a .npy file keyed by the tokenizer's content hash and written atomically; packed example i is
  [CLS] + tokens[i·W, (i+1)·W) + [SEP] with W = max_length − 2, so nearly every position is a real token
  (RoBERTa's FULL-SENTENCES packing, across document boundaries). Being a fixed array, it is random
  access, and the IndexedSource stream (deterministic in (seed, step), resumable) applies unchanged.
- Masking (BERT): ⌈rate·n⌉ of a row's n text tokens (not [CLS]/[SEP]/padding; rate 15 %) are prediction targets, chosen uniformly
  without replacement; of those 80 % become [MASK], 10 % a random non-special token, 10 % stay. At most
  P = ⌈rate·max_length⌉ + 1 targets per row (BERT's max_predictions_per_seq; 78 at 512). Train rows are
  masked afresh at every step from the per-example rng (dynamic masking, as RoBERTa); eval rows with a
  fixed rng per row, so every evaluation scores the same targets.

- Document boundaries (`packing`): "stream" lets every token attend to the documents before it in its
  row (RoBERTa's FULL-SENTENCES, GPT-2's packing); "documents" adds segment_ids and positions [B, L]
  int32 so the model keeps each token within its own document: tokens of one document share a segment
  id (0, 1, ... along the row), positions restart at 0 at each document's first token in the row (a
  document cut by the row's start starts at 0 too), and padding has the id after the last real one
  (no real token's) and position 0. They are computed from the row when it is read, so the cached
  token arrays serve both. Where a document starts is each class's (its docstring). MaskedText
  defaults to "stream" (RoBERTa's MLM default), CausalText to "documents".

MaskedText's batch: input_ids, token_type_ids (zeros), attention_mask [B, L]; mlm_positions, mlm_ids
[B, P] int32 and mlm_weights [B, P] float32 (1 for a real target); with "documents", segment_ids and
positions. CausalText packs rows of max_length tokens without [CLS] and predicts each next token (its
docstring).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from pathlib import Path

import numpy as np

from favor.data import files, local, tokenizers
from favor.data.atomic import unique_tag
from favor.data.source import IndexedSource, open_tfds, records, text

EVAL_MASK_SEED = 0x5EED
PACKING = ("documents", "stream")


def _read_texts(src, field, rows):
    out = []
    for start in range(0, len(rows), 512):
        for record in records(src, rows[start:start + 512]):
            if field not in record:
                raise KeyError(f"text field {field!r} not in the dataset's features {sorted(record)}")
            out.append(text(record[field]))
    return out


def train_tokenizer(src, field, output, vocab_size, sample, seed=0):
    """A sentencepiece model trained on `sample` documents drawn without replacement (seeded), written
    atomically (tokenizers.train_sentencepiece)."""
    n = len(src)
    rows = np.sort(np.random.default_rng(seed).permutation(n)[:min(int(sample), n)])
    return tokenizers.train_sentencepiece(_read_texts(src, field, rows), output, vocab_size)


def pack(src, field, tokenizer, path, max_documents=0) -> np.ndarray:
    """The split's documents as one token stream ([SEP] after each), cached at `path` (memory-mapped)."""
    path = Path(path)
    if not path.exists():
        n = len(src) if not max_documents else min(len(src), int(max_documents))
        dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max else np.int32
        pieces = []
        for start in range(0, n, 4096):
            for ids in tokenizer.ids(_read_texts(src, field, np.arange(start, min(start + 4096, n)))):
                pieces.append(np.asarray([*ids, tokenizer.sep_id], dtype))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{unique_tag()}.tmp.npy")
        np.save(tmp, np.concatenate(pieces) if pieces else np.zeros((0,), dtype))
        os.replace(tmp, path)                # atomic: a killed run never leaves a half-written cache
    return np.load(path, mmap_mode="r")


def mask_row(ids: np.ndarray, candidates: np.ndarray, rng, rate, max_predictions, mask_id, random_ids):
    """BERT masking of one packed row (in place on `ids`) among its `candidates` (the positions of its
    text tokens: not [CLS], [SEP] or padding); returns (positions, target ids, weights), each of length
    max_predictions."""
    n = len(candidates)
    k = min(max(1, math.ceil(rate * n)), max_predictions, n)
    positions = np.sort(rng.choice(candidates, size=k, replace=False))
    targets = ids[positions].copy()
    u = rng.random(k)
    ids[positions[u < 0.8]] = mask_id
    swap = (u >= 0.8) & (u < 0.9)
    ids[positions[swap]] = rng.choice(random_ids, size=int(swap.sum()))
    pad = max_predictions - k
    return (np.pad(positions, (0, pad)), np.pad(targets, (0, pad)),
            np.pad(np.ones(k, np.float32), (0, pad)))


def document_layout(starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions), each [length] int32, of a row whose first n = len(starts) positions are
    real tokens and the rest padding; starts [n] bool marks the tokens that begin a new document (a mark
    on the row's first token is ignored: whatever it holds, it begins the row's first segment, id 0)."""
    n = len(starts)
    begins = np.asarray(starts, bool).copy()
    if n:
        begins[0] = True
    index = np.arange(n)
    segment_ids = np.empty(length, np.int32)
    positions = np.zeros(length, np.int32)
    segment_ids[:n] = np.cumsum(begins) - 1
    positions[:n] = index - np.maximum.accumulate(np.where(begins, index, 0))
    # padding: an id no real token has, so no model ever lets a token and padding share a segment
    segment_ids[n:] = segment_ids[n - 1] + 1 if n else 0
    return segment_ids, positions


class PackedText(IndexedSource):
    """A text builder's splits tokenized into packed token streams (what both text objectives read):
    the tokenizer, `tokens[split]`, and rows of `width` tokens."""

    PACKING = PACKING          # what favor.data.check accepts for `packing`, before anything is built

    OPTIONS = {"dataset": "wikipedia/20230601.en", "text_field": "text", "train_split": "train[:99%]",
               "eval_split": "train[99%:]", "data_dir": None, "tokenizer": "", "vocab_size": 32000,
               "tokenizer_sample": 200_000, "max_length": 512, "max_documents": 0, "max_eval_rows": 2048,
               "packing": "stream"}

    def __init__(self, dataset="wikipedia/20230601.en", text_field="text", train_split="train[:99%]",
                 eval_split="train[99%:]", data_dir=None, tokenizer="", vocab_size=32000,
                 tokenizer_sample=200_000, max_length=512, max_documents=0, max_eval_rows=2048,
                 packing="stream"):
        if int(max_length) < 8:
            raise ValueError(f"text: max_length must be at least 8; got {max_length!r}")
        if packing not in PACKING:
            raise ValueError(f"text: packing must be one of {', '.join(map(repr, PACKING))}; got {packing!r}")
        self.packing = packing
        if dataset == "local":
            data_dir = local.prepare("docstrings", data_dir)
            dataset = local.builder_name("docstrings")
        self.dataset, self.max_length = dataset, int(max_length)
        self.max_eval_rows = int(max_eval_rows)
        cache = Path(data_dir).expanduser() if data_dir else local.cache_dir()
        if files.is_files(dataset):           # the user's own text files: no TFDS builder
            read = files.open_splits(dataset, text_field, {"data.train_split": train_split,
                                                           "data.eval_split": eval_split})
            train_src, eval_src = read["data.train_split"], read["data.eval_split"]
            safe = files.cache_name(dataset)
        else:
            train_src = open_tfds(dataset, train_split, data_dir)
            eval_src = open_tfds(dataset, eval_split, data_dir)
            safe = dataset.replace("/", "_")
        if tokenizer:
            self.tokenizer = tokenizers.get(tokenizer)
        else:
            # named by everything that decides its content: another field, split or sample is another model
            what = f"{text_field}|{train_split}|{int(tokenizer_sample)}|{int(vocab_size)}"
            model = (cache / "favor_tokenizers" /
                     f"{safe}-{int(vocab_size)}-{hashlib.sha256(what.encode()).hexdigest()[:8]}.model")
            self.tokenizer = (tokenizers.SentencePiece(model) if model.exists() else
                              train_tokenizer(train_src, text_field, model, vocab_size, tokenizer_sample))
        self.vocab_size = self.tokenizer.vocab_size
        fingerprint = _fingerprint(self.tokenizer)
        packed = cache / "favor_packed" / safe
        cached = lambda name: packed / f"{_safe_split(name)}-{_safe_split(text_field)}-{fingerprint}-{int(max_documents)}.npy"
        self.tokens = {
            split: pack(src, text_field, self.tokenizer, cached(name), max_documents)
            for split, src, name in (("train", train_src, train_split), ("eval", eval_src, eval_split))}
        if self.num_examples("train") == 0:
            raise ValueError(f"text: {dataset} {train_split} has no tokens to train on")

    @property
    def width(self) -> int:
        """Stream tokens per row."""
        return self.max_length - 2

    def num_examples(self, split):
        n = math.ceil(len(self.tokens[split]) / self.width)
        return min(n, self.max_eval_rows) if split == "eval" and self.max_eval_rows else n


class MaskedText(PackedText):
    """BERT's masked-LM rows: [CLS] + a chunk of the stream + [SEP]. With packing "documents", a [SEP]
    inside the chunk ends its document and the next token starts another: a token's segment is the number
    of the chunk's [SEP]s before it. The [CLS] belongs to the row's first document and the final [SEP] to
    its last (after a chunk that ends in [SEP], a segment of its own)."""

    OPTIONS = {**PackedText.OPTIONS, "mask_rate": 0.15, "packing": "stream"}

    def __init__(self, mask_rate=0.15, **options):
        if not 0.0 < float(mask_rate) < 1.0:
            raise ValueError(f"text: mask_rate must be in (0, 1); got {mask_rate!r}")
        super().__init__(**options)
        if self.tokenizer.mask_id is None:
            raise ValueError(f"text: masked-LM data needs a tokenizer with a [MASK] token; "
                             f"{options.get('tokenizer')!r} has none (use it with causal_text)")
        self.rate = float(mask_rate)
        self.max_predictions = math.ceil(self.rate * self.max_length) + 1
        tok = self.tokenizer
        special = {tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id}
        self.random_ids = np.asarray([i for i in range(self.vocab_size) if i not in special], np.int32)

    def layout(self, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segment_ids, positions) [max_length] of the row [CLS] + chunk + [SEP]: row position t > 1
        begins a document when the chunk token before it (row position t − 1) is a [SEP]."""
        starts = np.zeros(len(chunk) + 2, bool)
        starts[2:] = chunk == self.tokenizer.sep_id
        return document_layout(starts, self.max_length)

    def read(self, split, global_rows, local_rows, rngs):
        tok, length, p = self.tokenizer, self.max_length, self.max_predictions
        stream = self.tokens[split]
        b = len(local_rows)
        out = {"input_ids": np.full((b, length), tok.pad_id, np.int32),
               "token_type_ids": np.zeros((b, length), np.int32),
               "attention_mask": np.zeros((b, length), np.int32),
               "mlm_positions": np.zeros((b, p), np.int32), "mlm_ids": np.zeros((b, p), np.int32),
               "mlm_weights": np.zeros((b, p), np.float32)}
        documents = self.packing == "documents"
        if documents:
            out["segment_ids"], out["positions"] = np.zeros((b, length), np.int32), np.zeros((b, length), np.int32)
        for i, row in enumerate(local_rows):
            chunk = np.asarray(stream[int(row) * self.width:(int(row) + 1) * self.width], np.int32)
            n = len(chunk)
            ids = out["input_ids"][i]
            ids[0], ids[1:n + 1], ids[n + 1] = tok.cls_id, chunk, tok.sep_id
            out["attention_mask"][i, :n + 2] = 1
            if documents:
                out["segment_ids"][i], out["positions"][i] = self.layout(chunk)
            rng = rngs[i] if rngs is not None else np.random.default_rng([EVAL_MASK_SEED, int(row)])
            candidates = np.flatnonzero(chunk != tok.sep_id) + 1
            pos, tgt, w = mask_row(ids, candidates, rng, self.rate, p, tok.mask_id, self.random_ids)
            out["mlm_positions"][i], out["mlm_ids"][i], out["mlm_weights"][i] = pos, tgt, w
        return out


class CausalText(PackedText):
    """Next-token prediction on the packed stream (GPT-2's packing: rows run across document boundaries,
    [SEP] ending each document): row i reads tokens[i·L, (i+1)·L] with L = max_length; its input is the
    first L of them and its targets the last L (each position predicts the token after it), so every
    stream token but the first is a target exactly once. The last row is padded (weights 0).

    With packing "documents" (the default), the end-of-text token ([SEP]) that ends a document begins the
    next as its first token (GPT-2's <|endoftext|> as BOS): a token's segment is the number of [SEP]s at
    or before it in the row (less one when the row opens with a [SEP], so ids start at 0). So a document's
    last token predicts its end-of-text token from its own document, and that token, as input, predicts
    the next document's first token from itself alone.

    Batch: input_ids, attention_mask, targets [B, L] int32 and weights [B, L] float32 (1: a real target);
    with "documents", segment_ids and positions [B, L] int32."""

    OPTIONS = {**PackedText.OPTIONS, "packing": "documents"}

    def __init__(self, packing="documents", **options):
        super().__init__(packing=packing, **options)

    @property
    def width(self) -> int:
        return self.max_length

    def num_examples(self, split):
        n = math.ceil(max(len(self.tokens[split]) - 1, 0) / self.width)
        return min(n, self.max_eval_rows) if split == "eval" and self.max_eval_rows else n

    def read(self, split, global_rows, local_rows, rngs):
        tok, length = self.tokenizer, self.max_length
        stream = self.tokens[split]
        b = len(local_rows)
        out = {"input_ids": np.full((b, length), tok.pad_id, np.int32),
               "attention_mask": np.zeros((b, length), np.int32),
               "targets": np.full((b, length), tok.pad_id, np.int32), "weights": np.zeros((b, length), np.float32)}
        documents = self.packing == "documents"
        if documents:
            out["segment_ids"], out["positions"] = np.zeros((b, length), np.int32), np.zeros((b, length), np.int32)
        for i, row in enumerate(local_rows):
            chunk = np.asarray(stream[int(row) * length:(int(row) + 1) * length + 1], np.int32)
            n = len(chunk) - 1
            out["input_ids"][i, :n], out["targets"][i, :n] = chunk[:-1], chunk[1:]
            out["attention_mask"][i, :n], out["weights"][i, :n] = 1, 1.0
            if documents:
                out["segment_ids"][i], out["positions"][i] = document_layout(chunk[:-1] == tok.sep_id, length)
        return out


def _fingerprint(tok) -> str:
    """A short content hash of the tokenizer, so a retrained tokenizer never reuses stale packed tokens."""
    h = hashlib.sha256()
    if isinstance(tok, tokenizers.SentencePiece):
        h.update(tok.sp.serialized_model_proto())
    else:
        h.update(repr(sorted(tok.tok.get_vocab().items())).encode())
    return h.hexdigest()[:12]


def _safe_split(split: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in split)


def main(argv=None):
    """`python -m favor.data.text tokenizer --dataset D --vocab_size V --output M`: train the corpus's
    sentencepiece model ahead of a run (what a run with an empty `tokenizer` does on first use)."""
    parser = argparse.ArgumentParser(prog="python -m favor.data.text")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tokenizer", help="train a sentencepiece model on a sample of a TFDS text corpus")
    t.add_argument("--dataset", default="local", help="a TFDS text builder, or 'local' (standard-library docstrings)")
    t.add_argument("--split", default="train")
    t.add_argument("--text_field", default="text")
    t.add_argument("--data_dir", default=None)
    t.add_argument("--vocab_size", type=int, default=32000)
    t.add_argument("--sample", type=int, default=200_000, help="documents to train on")
    t.add_argument("--output", required=True, help="model path (<output>.model and .vocab are written)")
    args = parser.parse_args(argv)
    data_dir, dataset = args.data_dir, args.dataset
    if dataset == "local":
        data_dir, dataset = local.prepare("docstrings", data_dir), local.builder_name("docstrings")
    tok = train_tokenizer(open_tfds(dataset, args.split, data_dir), args.text_field, args.output, args.vocab_size,
                          args.sample)
    print(f"{tokenizers.model_prefix(args.output)}.model: {tok.vocab_size} pieces")


if __name__ == "__main__":
    main()
