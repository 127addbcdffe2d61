"""ListOps trees by Long Range Arena's rules (Nangia & Bowman 2018): the tokens, the length windows, the
generator and the answers. Pure Python and numpy, so a config reads its constants without the TFDS
dataset (favor.data.listops) that builds on them.

The generator's rules (LRA, lra_benchmarks/data/listops.py, restated): a node above the maximum depth
is an operator with probability 1/4, else a digit drawn uniformly; at the maximum depth, a digit. An
operator, drawn uniformly from the four, takes 2…max_args arguments (uniform), each a node one level
deeper. The root is at depth 1. A tree's length counts its tokens — an operator, its arguments, its
closing bracket — and a tree is kept when min_length < length < max_length; the kept trees are
distinct. MED is the median truncated to an integer (of an even count, the mean of the middle two,
truncated), SM the sum mod 10. LRA: max_depth = max_args = 10, lengths 500-2000, 96,000 / 2,000 /
2,000 examples.

Tokens: the four operators, the closing bracket and the ten digits. The generator's text also wraps
every pair of its binary tree in parentheses; they repeat what the operators and brackets say, and are
left out. (LRA's tokenizer split on non-alphanumerics and so dropped the brackets as well, which leaves
an expression ambiguous — where does an argument list end? favor keeps them.) The first position holds
a [CLS] token for the classifier's pooling.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np

OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
END = "]"
OPERATOR_P = 0.25
PAD, CLS = 0, 1
VOCAB = ("[PAD]", "[CLS]", END, *OPERATORS, *(str(d) for d in range(10)))
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Window:
    min_length: int                 # kept: min_length < length < max_length (tokens, no [CLS])
    max_length: int
    num_train: int
    num_validation: int
    num_test: int
    max_depth: int = 10
    max_args: int = 10


# The LRA protocol, and shorter windows this project's 2-core machines train on (the same rules and
# depth; a quarter of the maximum as the minimum, as LRA's 500 of 2000)
WINDOWS = {
    "lra": Window(500, 2000, 96_000, 2_000, 2_000),
    "1024": Window(256, 1024, 20_000, 1_000, 1_000),
    "512": Window(128, 512, 20_000, 1_000, 1_000),
    "256": Window(64, 256, 20_000, 1_000, 1_000),
    # shallower trees in a short window: the depth LRA's trees reach is what keeps a small model on the
    # plateau of the outermost operator (README, ListOps); here the nesting is learnable in minutes
    "shallow": Window(32, 128, 20_000, 1_000, 1_000, max_depth=4, max_args=6),
    "tiny": Window(8, 40, 96, 32, 32),            # the tests'
}


def generate(rng: random.Random, depth: int = 1, max_depth: int = 10, max_args: int = 10):
    """One tree: a digit, or (operator, [arguments])."""
    if depth < max_depth and rng.random() <= OPERATOR_P:
        args = [generate(rng, depth + 1, max_depth, max_args) for _ in range(rng.randint(2, max_args))]
        return rng.choice(OPERATORS), args
    return rng.randrange(10)


def tokens(tree) -> list[str]:
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    return [op, *(t for a in args for t in tokens(a)), END]


def value(tree) -> int:
    """The tree's answer."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    vals = [value(a) for a in args]
    if op == "[MAX":
        return max(vals)
    if op == "[MIN":
        return min(vals)
    if op == "[MED":
        return int(np.median(vals))
    return sum(vals) % 10


def examples(window: Window, seed: int):
    """Distinct (tokens, answer) pairs within `window`, enough for its three splits, in generation order."""
    rng, seen, out = random.Random(seed), set(), []
    total = window.num_train + window.num_validation + window.num_test
    while len(out) < total:
        tree = generate(rng, 1, window.max_depth, window.max_args)
        toks = tokens(tree)
        if window.min_length < len(toks) < window.max_length:
            key = " ".join(toks)
            if key not in seen:
                seen.add(key)
                out.append((key, value(tree)))
    return out
