"""`favor_docstring_order`: sentence-order prediction on the standard library's docstrings, a local
classification task in GLUE's sentence-pair format (`configs/bert_glue.py:task=docorder`).

Each example is two consecutive sentences of one docstring, in their order (label 1) or swapped
(label 0), ALBERT's sentence-order prediction. Every pair comes in both orders, so the classes are
exactly balanced (a constant guess scores 50 %) and the two examples of a pair hold the same tokens:
a count of tokens cannot tell them apart. A model without token mixing keeps cues of one segment
alone (a sentence that opens with "Otherwise" rarely comes first); the rest takes relating the two
sentences' contents, which is what attention does. It comes from the corpus the local BERT source
pretrains on (`favor_docstrings`), with the same split by module, so validation pairs come from
modules neither the pretraining nor the fine-tuning saw.

Sentences: a docstring's paragraphs (blank-line separated; paragraphs that look like code, doctest,
field or bullet lists, directives or sections such as "Args:" are dropped) joined into text and cut
after '.', '!' or '?' followed by a space and an upper-case letter (not after "e.g." and the like). A
pair is two consecutive sentences of one paragraph, kept when both have 3-60 words. A validation pair
that is also a training pair (sibling modules repeat docstrings) is dropped. The dataset is the same
on every machine with the same Python.
"""

from __future__ import annotations

import re

from favor import extras
from favor.data.docstrings import of_split

tfds = extras.tfds("the sentence-order corpus (a TFDS builder)")

MIN_WORDS, MAX_WORDS = 3, 60
# a sentence ends at . ! ? before a space and a capital, but not after the abbreviations docstrings use
_SENTENCE_END = re.compile(r"(?<!\be\.g\.)(?<!\bi\.e\.)(?<!\betc\.)(?<!\bvs\.)(?<!\bcf\.)(?<=[.!?])\s+(?=[A-Z])")
# lines that make a paragraph something other than prose: doctest, reST fields, directives and rules,
# bullets and numbered items, shell prompts, section headers ("Args:", "Returns:")
_NOT_PROSE = re.compile(r"^(>>>|\.\.\.|\.\. |:\w|[-=*~^]{3,}|[-*+] |\d+[.)] |\$ |\w+( \w+)?:$)")


def paragraphs(doc: str) -> list[list[str]]:
    """The prose paragraphs of a docstring, each as its sentences in order."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        raw = [ln for ln in para.splitlines() if ln.strip()]
        # an indented line is code or the body of a list or section (docstrings come dedented)
        if not raw or any(_NOT_PROSE.match(ln.strip()) or ln[:1].isspace() for ln in raw):
            continue
        text = " ".join(para.split())                   # one space between words, as the tokenizer sees it
        out.append([s.strip() for s in _SENTENCE_END.split(text) if s.strip()])
    return out


def pairs(doc: str):
    """(index, first, second) of each kept pair of consecutive sentences of one paragraph (a pair across
    a dropped code block would not be consecutive text), in the docstring's order."""
    i = 0
    for sents in paragraphs(doc):
        for a, b in zip(sents, sents[1:]):
            if all(MIN_WORDS <= len(s.split()) <= MAX_WORDS for s in (a, b)):
                yield i, a, b
            i += 1


class FavorDocstringOrder(tfds.core.GeneratorBasedBuilder):
    """Sentence-order prediction on the Python standard library's docstrings."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Consecutive docstring sentences, in order or swapped; split by module."}

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "sentence1": tfds.features.Text(), "sentence2": tfds.features.Text(),
                "label": tfds.features.ClassLabel(names=["swapped", "in_order"]), "idx": tfds.features.Text()}),
            homepage="https://docs.python.org/3/library/")

    def _split_generators(self, dl_manager):
        # sibling modules repeat docstrings (posixpath / ntpath): a validation pair whose two sentences
        # also make a training pair is dropped, so no validation example was seen in training
        train = list(of_split("train"))            # parsed once: read for `seen` and written below
        seen = {(a, b) for _, doc in train for _, a, b in pairs(doc)}
        return {"train": self._generate_examples(train),
                "validation": self._generate_examples(of_split("validation"), seen)}

    def _generate_examples(self, docs, seen=frozenset()):
        """Both orders of each consecutive pair of sentences of `docs` ((name, docstring) pairs) not in `seen`."""
        for name, doc in docs:
            for i, first, second in pairs(doc):
                if (first, second) in seen:
                    continue
                for label, (s1, s2) in ((1, (first, second)), (0, (second, first))):
                    key = f"{name}#{i}{'' if label else '~'}"
                    yield key, {"sentence1": s1, "sentence2": s2, "label": label, "idx": key}
