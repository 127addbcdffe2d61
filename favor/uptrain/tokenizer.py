"""The tokenizer travels with the model: a run records the tokenizer its data source used in
`<workdir>/tokenizer/` (`record_tokenizer`), and a run whose `init_from` is a favor run, with no
`data.tokenizer` of its own, encodes text with that one (`tokenizer_spec`)."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from favor.data.atomic import write_text
from favor.uptrain.init_from import open_checkpoint, parse

TOKENIZER_DIR = "tokenizer"
# favor's record of the spec, beside the tokenizer's own files: a name no tokenizer's file takes (a
# Hugging Face tokenizer is a tokenizer.json, which the record must never overwrite)
RECORD = "favor_tokenizer.json"
# where an older favor kept the record; read when it holds a spec (a Hugging Face tokenizer.json does not)
OLD_RECORD = "tokenizer.json"


def record_tokenizer(source, workdir: Path) -> None:
    """Copy the tokenizer `source` (a data source) encodes with into `<workdir>/tokenizer/`, its files
    as they are, with its spec beside them (favor_tokenizer.json), so a run that starts from this one can
    encode text as it did. Process 0 writes; each file is renamed into place, so a reader finds whole
    files. A run that has recorded its tokenizer keeps that record: a resumed run encodes with it
    already, and its files are not rewritten."""
    tok = getattr(source, "tokenizer", None)
    if tok is None or not hasattr(tok, "save") or jax.process_index() != 0:
        return
    directory = Path(workdir) / TOKENIZER_DIR
    if _spec_in(directory) is not None:
        return
    spec = tok.save(directory)
    write_text(directory / RECORD, json.dumps({"spec": spec}))


def _spec_in(directory: Path) -> str | None:
    for name in (RECORD, OLD_RECORD):
        try:
            record = json.loads((directory / name).read_text())
        except (OSError, ValueError):        # absent, or a file of the tokenizer's own that is not a record
            continue
        if isinstance(record, dict) and isinstance(record.get("spec"), str):
            return record["spec"]
    return None


def recorded_tokenizer(workdir: Path | None) -> str | None:
    """The tokenizer spec a run recorded in its workdir (absolute paths), or None."""
    if workdir is None:
        return None
    directory = Path(workdir) / TOKENIZER_DIR
    spec = _spec_in(directory)
    if spec is None:
        return None
    kind, _, rest = spec.partition(":")
    return f"{kind}:{(directory / rest).absolute()}"


def tokenizer_spec(config, workdir: Path) -> str | None:
    """The tokenizer a run with an empty `data.tokenizer` uses: the one it recorded itself (a resumed
    run), else its init_from run's, else (hf:) the checkpoint's vocab.txt; None when none applies."""
    if "tokenizer" not in config.data or config.data.tokenizer:
        return None
    own = recorded_tokenizer(workdir)
    if own:
        return own
    spec = str(config.model.get("init_from", "") or "")
    if not spec:
        return None
    origin = parse(spec)
    if origin.kind == "run":
        found = recorded_tokenizer(origin.workdir)
        if found is None and origin.workdir is not None:
            # a run from before tokenizers were recorded: the tokenizer its config named, if any
            ckpt = open_checkpoint(origin)
            found = str(ckpt.config.get("data", {}).get("tokenizer", "") or "") or None
        return found
    vocab = origin.path / "vocab.txt"
    return f"wordpiece:{vocab}" if vocab.exists() else None
