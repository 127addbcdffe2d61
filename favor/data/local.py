"""Offline corpora that favor generates itself, as real TFDS datasets in a local cache.

`data=local` in a config points a pipeline at one of these instead of the downloaded dataset; the
pipeline code is the same (random access through `favor.data.source.open_tfds`), only the builder
name and data_dir differ. A corpus is built on first use (idempotent: a prepared one is reused) by
`prepare(name)` or from the command line:

    python -m favor.data.local docstrings [--data_dir DIR]     # text for MLM pretraining
    python -m favor.data.local speech [--data_dir DIR]         # espeak-ng speech for the Conformer
    python -m favor.data.local speech --config hard            # longer, noisier, speed-perturbed speech
    python -m favor.data.local listops [--config 512]          # ListOps by LRA's rules
    python -m favor.data.local docorder                        # sentence order of docstrings, GLUE-style

The cache is $FAVOR_DATA_DIR, else ~/.cache/favor/tensorflow_datasets.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

from favor import extras

CORPORA = {
    "docstrings": ("favor.data.docstrings", "favor_docstrings"),
    "speech": ("favor.data.espeak", "favor_speech"),
    "listops": ("favor.data.listops", "favor_listops"),
    "docorder": ("favor.data.docorder", "favor_docstring_order"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("FAVOR_DATA_DIR", "~/.cache/favor/tensorflow_datasets")).expanduser()


def builder_name(corpus: str) -> str:
    if corpus not in CORPORA:
        raise ValueError(f"unknown local corpus {corpus!r}; valid: {', '.join(CORPORA)}")
    module, name = CORPORA[corpus]
    importlib.import_module(module)          # registers the TFDS builder class under `name`
    return name


def prepare(corpus: str, data_dir=None, config: str | None = None) -> str:
    """Build the corpus (a named builder config of it, e.g. the speech corpus's "tiny") into data_dir
    (default: the cache) unless it is there; returns the data_dir."""
    tfds = extras.tfds(f"the local corpus {corpus!r} (a TFDS builder)")    # loads TFDS only when data is read
    name = builder_name(corpus)
    data_dir = str(Path(data_dir).expanduser() if data_dir else cache_dir())
    try:
        builder = tfds.builder(f"{name}/{config}" if config else name, data_dir=data_dir, file_format="array_record")
    except ValueError as e:       # an unknown config: TFDS's message lists the valid ones
        raise ValueError(f"local corpus {corpus!r}: {e}") from e
    builder.download_and_prepare()           # a no-op when the prepared version is present
    # the corpus's directory exists once prepared, whatever the builder wrote (a mocked build writes
    # nothing): readers treat a data_dir that does not exist as a mistake in the config
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    return data_dir


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m favor.data.local", description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", choices=sorted(CORPORA))
    parser.add_argument("--data_dir", default=None, help=f"default: {cache_dir()}")
    parser.add_argument("--config", default=None, help="a builder config of the corpus (speech: tiny, hard; listops: "
                                                       "256, 512, 1024, lra, tiny); default: the corpus's first")
    args = parser.parse_args(argv)
    print(prepare(args.corpus, args.data_dir, args.config))


if __name__ == "__main__":
    main()
