"""`favor_docstrings`: English text for offline MLM pretraining, the docstrings of the Python standard
library of the interpreter that builds it (read with `ast`, nothing is imported or executed).

One example per docstring of a module, class or function: {"title": "json.decoder.JSONDecoder.decode",
"text": <the cleaned docstring>}. Docstrings shorter than 40 characters are left out (mostly
"Return x." stubs). The split is by module (a stable hash of its name): 95 % train, 5 % validation, so
validation text comes from modules the model never saw.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

from favor import extras

tfds = extras.tfds("the docstring corpus (a TFDS builder)")

MIN_CHARS = 40


def stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in skip for part in rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out.append((module, path))
    return out


def docstrings(module: str, path: Path):
    """(qualified name, docstring) of the module and every class and function in it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return
    stack = [(module, tree)]
    while stack:
        name, node = stack.pop(0)
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= MIN_CHARS:
            yield name, doc
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                stack.append((f"{name}.{child.name}", child))


def split_of(module: str) -> str:
    h = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16) % 100
    return "validation" if h < 5 else "train"


def of_split(split: str):
    """(qualified name, docstring) of every docstring of the split's modules, in a stable order."""
    for module, path in stdlib_files():
        if split_of(module) == split:
            yield from docstrings(module, path)


class FavorDocstrings(tfds.core.GeneratorBasedBuilder):
    """Docstrings of the Python standard library, for offline MLM pretraining."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Module, class and function docstrings of >= 40 characters."}

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"title": tfds.features.Text(), "text": tfds.features.Text()}),
            homepage="https://docs.python.org/3/library/")

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(split) for split in ("train", "validation")}

    def _generate_examples(self, split):
        for name, doc in of_split(split):
            yield name, {"title": name, "text": doc}
