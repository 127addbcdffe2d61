"""Optional dependencies: packages only some pipelines need, imported where those pipelines run, with a
one-line error naming the pip extra that installs them.

TensorFlow and TensorFlow Datasets are such packages: many GPU and TPU images carry JAX without them
(and installing both fights over CUDA libraries), so a plain `pip install favor` runs the default job,
MQAR, the benchmarks and every model without them, and `pip install 'favor[tfds]'` adds the TFDS
pipelines (GLUE, ImageNet, LibriSpeech, the MLM text builders and favor's local corpora, which are TFDS
builders).
"""

from __future__ import annotations

import importlib

# module -> the extra of pyproject.toml that installs it
EXTRAS = {"tensorflow_datasets": "tfds", "tensorflow": "tfds"}


class MissingExtra(ImportError):
    """An optional package a pipeline needs is not installed; the message names the extra."""


def require(module: str, purpose: str):
    """The module, imported; if it is not installed, a MissingExtra saying what needs it and the pip
    extra that installs it."""
    extra = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        # a module that is installed but fails inside its own import is not a missing extra: re-raise
        missing = getattr(e, "name", None)
        if missing is None or missing.split(".")[0] not in EXTRAS:
            raise
        raise MissingExtra(f"{purpose} needs {module}, which cannot be imported (no module {missing!r}); "
                           f"install favor's {extra!r} extra: pip install 'favor[{extra}]'") from None


def tfds(purpose: str):
    """tensorflow_datasets, for `purpose` (what a missing-extra error says needs it)."""
    return require("tensorflow_datasets", purpose)
