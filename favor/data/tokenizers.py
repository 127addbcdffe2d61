"""Tokenizers by spec string: "wordpiece:<vocab.txt>[:cased]" for Hugging Face BERT checkpoints
(their WordPiece vocabulary through the `tokenizers` library, so text is split exactly as BERT's own
tokenizer does), "hf:<dir>" for a Hugging Face checkpoint's tokenizer.json (GPT-2's byte-level BPE,
Llama's: what a decoder imported from one reads) and "sentencepiece:<model>" for models trained here.

Every tokenizer encodes single sentences and pairs as BERT does: [CLS] a [SEP] (b [SEP]), token type
0 for the first segment and 1 for the second, truncated longest-first to `max_length`.
"""

from __future__ import annotations

import abc
import json
import os
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tokenizers import BertWordPieceTokenizer
from tokenizers import Tokenizer as FastTokenizer

from favor.data.atomic import copy_file, unique_tag

KINDS = ("wordpiece", "sentencepiece", "hf")
# the spec forms `get` takes, as errors name them
FORMS = "'wordpiece:<vocab.txt>[:cased]', 'sentencepiece:<model file>' or 'hf:<directory with tokenizer.json>'"


class Tokenizer(abc.ABC):
    cls_id: int
    sep_id: int
    pad_id: int
    mask_id: int
    vocab_size: int

    @abc.abstractmethod
    def ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""

    @abc.abstractmethod
    def save(self, directory) -> str:
        """Copy the tokenizer's files into `directory`; its spec there, relative to `directory`."""

    def encode(self, first: list[str], second: list[str] | None, max_length: int):
        """(input_ids, token_type_ids, attention_mask), each [N, max_length] int32 (padded)."""
        if max_length < 3 + (second is not None):
            raise ValueError(f"max_length {max_length} leaves no room for text")
        a = self.ids(first)
        b = self.ids(second) if second is not None else [None] * len(a)
        n = len(a)
        ids = np.full((n, max_length), self.pad_id, np.int32)
        types = np.zeros((n, max_length), np.int32)
        for i, (x, y) in enumerate(zip(a, b)):
            room = max_length - (3 if y is not None else 2)
            x, y = list(x), list(y) if y is not None else None
            while len(x) + (len(y) if y is not None else 0) > room:     # longest first, as BERT
                (x if y is None or len(x) >= len(y) else y).pop()
            row = [self.cls_id, *x, self.sep_id]
            seg = [0] * len(row)
            if y is not None:
                row += [*y, self.sep_id]
                seg += [1] * (len(y) + 1)
            ids[i, :len(row)], types[i, :len(row)] = row, seg
        return ids, types, (ids != self.pad_id).astype(np.int32)


class WordPiece(Tokenizer):
    def __init__(self, vocab_file, lowercase=True):
        vocab_file = Path(vocab_file)
        if not vocab_file.exists():
            raise FileNotFoundError(f"WordPiece vocabulary {vocab_file} does not exist (a BERT checkpoint's vocab.txt)")
        self.vocab_file, self.lowercase = vocab_file, lowercase
        self.tok = BertWordPieceTokenizer(str(vocab_file), lowercase=lowercase)
        vocab = self.tok.get_vocab()
        for name in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"):
            if name not in vocab:
                raise ValueError(f"{vocab_file} has no {name} token; is it a BERT vocab.txt?")
        self.cls_id, self.sep_id, self.pad_id, self.mask_id = (vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"))
        self.vocab_size = len(vocab)

    def ids(self, texts):
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def save(self, directory) -> str:
        copy_file(self.vocab_file, Path(directory) / "vocab.txt")
        return "wordpiece:vocab.txt" + ("" if self.lowercase else ":cased")


def _special(config: dict, name: str):
    """tokenizer_config.json's `name` token: a string, or a dict with its "content" (older files)."""
    value = config.get(name)
    return value.get("content") if isinstance(value, dict) else value


class HuggingFace(Tokenizer):
    """A Hugging Face tokenizer.json. Documents end with its end-of-text token (`sep_id`, which the packed
    text streams put after each document); `cls_id` is its beginning-of-text token (the end-of-text one
    where it has none, as GPT-2's), `pad_id` its pad token or else the end-of-text one. It has no [MASK]
    (`mask_id` None): masked-LM data refuses it. The special tokens come from tokenizer_config.json, or
    else from the names GPT-2 and Llama use."""

    EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>")
    BOS_NAMES = ("<s>", "<|begin_of_text|>")

    def __init__(self, directory):
        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist (save the Hugging Face tokenizer with save_pretrained: "
                                    f"a fast tokenizer writes tokenizer.json)")
        self.tok = FastTokenizer.from_file(str(path))
        cfg_file = self.directory / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.config = cfg
        vocab = self.tok.get_vocab(with_added_tokens=True)
        find = lambda name, fallbacks: next((vocab[t] for t in [_special(cfg, name), *fallbacks] if t in vocab), None)
        self.sep_id = find("eos_token", self.EOS_NAMES)
        if self.sep_id is None:
            raise ValueError(f"{self.directory}: no end-of-text token (tokenizer_config.json's eos_token, or one of "
                             f"{', '.join(self.EOS_NAMES)})")
        bos, pad = find("bos_token", self.BOS_NAMES), find("pad_token", ())
        self.cls_id = self.sep_id if bos is None else bos
        self.pad_id = self.sep_id if pad is None else pad
        self.mask_id = None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def ids(self, texts):
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def save(self, directory) -> str:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (self.directory / name).exists():
                copy_file(self.directory / name, Path(directory) / name)
        return "hf:."

    def chat_template(self) -> str | None:
        """The chat template as transformers finds it: chat_template.jinja beside tokenizer.json, else
        tokenizer_config.json's chat_template (a string, or named templates of which "default")."""
        f = self.directory / "chat_template.jinja"
        if f.exists():
            return f.read_text()
        t = self.config.get("chat_template")
        if isinstance(t, list):
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        return t if isinstance(t, str) and t else None

    def chat(self, prompt: str) -> str:
        """`prompt` as the user's turn of the chat template, ready for the model's reply: what transformers'
        apply_chat_template(messages, add_generation_prompt=True, tokenize=False) renders (jinja2 in a
        sandbox, blocks trimmed, the config's special tokens, raise_exception and strftime_now)."""
        template = self.chat_template()
        if template is None:
            raise ValueError(f"{self.directory}: the tokenizer has no chat template (chat_template.jinja or "
                             f"tokenizer_config.json's chat_template); give the prompt as plain text")
        import datetime

        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"{self.directory}: the chat template refused the prompt: {message}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
        tokens = {name: _special(self.config, name) or "" for name in ("bos_token", "eos_token", "pad_token")}
        return env.from_string(template).render(messages=[{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, **tokens)


class SentencePiece(Tokenizer):
    """A sentencepiece model trained by favor, with pieces [CLS] [SEP] [MASK] as user symbols and
    pad id 0 (see favor's tokenizer trainer)."""

    def __init__(self, model_file):
        if not Path(model_file).exists():
            raise FileNotFoundError(f"sentencepiece model {model_file} does not exist")
        self.model_file = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        piece = self.sp.piece_to_id
        self.cls_id, self.sep_id, self.mask_id = piece("[CLS]"), piece("[SEP]"), piece("[MASK]")
        self.pad_id = self.sp.pad_id()
        if min(self.cls_id, self.sep_id, self.mask_id) == self.sp.unk_id() or self.pad_id < 0:
            raise ValueError(f"{model_file} lacks [CLS]/[SEP]/[MASK] user symbols or a pad id")
        self.vocab_size = self.sp.get_piece_size()

    def ids(self, texts):
        return self.sp.encode(list(texts))

    def save(self, directory) -> str:
        copy_file(self.model_file, Path(directory) / "sentencepiece.model")
        return "sentencepiece:sentencepiece.model"

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


SPECIAL = ("[CLS]", "[SEP]", "[MASK]")


def model_prefix(output) -> str:
    """`output` without a trailing ".model": "tok/wiki.en" stays "tok/wiki.en" (files tok/wiki.en.model, .vocab)."""
    output = str(output)
    return output[:-len(".model")] if output.endswith(".model") else output


def train_sentencepiece(texts, output, vocab_size: int, model_type: str = "unigram",
                        character_coverage: float = 1.0, max_sentences: int = 1_000_000,
                        seed: int = 0) -> SentencePiece:
    """Train a sentencepiece model on `texts` (an iterable of str) and write `<prefix>.model`/`.vocab`
    (prefix: `output` without ".model"). Both are written under a temporary prefix of this process's own
    and renamed, .vocab first and .model last: a reader that finds the .model finds a whole model (hosts
    sharing a cache may train the same one at once).

    Ids: 0 = pad (also the CTC blank slot of speech models), 1 = unk, then [CLS] [SEP] [MASK] as user
    symbols (never split, never produced from text), no bos/eos. Trained on at most `max_sentences`
    lines, sampled here with a seeded generator: sentencepiece's own sampling is unseeded, and every host
    (and every rerun) must build the same vocabulary."""
    prefix = model_prefix(output)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    lines = (line.strip() for t in texts for line in str(t).splitlines())
    lines = [line for line in lines if line]
    if not lines:
        raise ValueError("train_sentencepiece: no text to train on")
    if len(lines) > max_sentences:
        keep = np.sort(np.random.default_rng(seed).choice(len(lines), int(max_sentences), replace=False))
        lines = [lines[i] for i in keep]
    tmp = f"{prefix}.tmp-{unique_tag()}"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=tmp, vocab_size=int(vocab_size),
        model_type=model_type, character_coverage=character_coverage, pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
        user_defined_symbols=list(SPECIAL), input_sentence_size=0, shuffle_input_sentence=False,
        hard_vocab_limit=False, minloglevel=2)
    for suffix in (".vocab", ".model"):
        os.replace(tmp + suffix, prefix + suffix)
    return SentencePiece(prefix + ".model")


def get(spec: str) -> Tokenizer:
    kind, _, rest = str(spec).partition(":")
    if kind not in KINDS or not rest:
        raise ValueError(f"unknown tokenizer {spec!r}; valid: {FORMS}")
    if kind == "hf":
        return HuggingFace(rest)
    if kind == "wordpiece":
        path, _, case = rest.partition(":")
        return WordPiece(path, lowercase=case != "cased")
    return SentencePiece(rest)
