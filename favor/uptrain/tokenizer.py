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


def record_tokenizer(source, workdir: Path) -> None:
    """Copy the tokenizer `source` (a data source) encodes with into `<workdir>/tokenizer/` with its
    spec (tokenizer.json), so a run that starts from this one can encode text as it did. Process 0
    writes; each file is renamed into place, so a reader finds whole files."""
    tok = getattr(source, "tokenizer", None)
    if tok is None or not hasattr(tok, "save") or jax.process_index() != 0:
        return
    directory = Path(workdir) / TOKENIZER_DIR
    spec = tok.save(directory)
    write_text(directory / "tokenizer.json", json.dumps({"spec": spec}))


def recorded_tokenizer(workdir: Path | None) -> str | None:
    """The tokenizer spec a run recorded in its workdir (absolute paths), or None."""
    if workdir is None:
        return None
    f = Path(workdir) / TOKENIZER_DIR / "tokenizer.json"
    if not f.exists():
        return None
    spec = json.loads(f.read_text())["spec"]
    kind, _, rest = spec.partition(":")
    return f"{kind}:{(f.parent / rest).absolute()}"


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
