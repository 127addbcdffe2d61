"""Your own text as a corpus: plain-text and JSONL files, read where a text pipeline reads a TFDS builder.

    data.dataset = "files:/data/notes/*.txt"        # or "files:/data/corpus.jsonl", "files:/data/dir"

`files:<path>` names a file, a directory (every .txt, .jsonl and .json file under it) or a glob (`**`
included). Documents: a .jsonl/.json file has one JSON object per line, its text under the pipeline's
`text_field` ("text" by default); a .txt file has one document per block of lines between blank lines
(paragraphs: a text file's one long document would never reach the evaluation split). Files are read in
sorted path order and documents in file order, so the splits are stable.

Splits are TFDS's slicing of the one "train" split the files make: `train`, `train[:98%]`, `train[98%:]`,
`train[a:b]` (documents), so a pipeline's `train_split`/`eval_split` keep their meaning. The files'
paths, sizes and modification times name the cache of the tokenizer trained on them and of their packed
tokens: edited files are tokenized again. No TensorFlow is needed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import re
from pathlib import Path

from favor.config.checks import ConfigError

PREFIX = "files:"
SUFFIXES = (".txt", ".jsonl", ".json")
SPLIT_FORMS = "'train', 'train[:N%]', 'train[N%:]', 'train[A%:B%]' or 'train[A:B]' (documents)"


def is_files(dataset) -> bool:
    return str(dataset).startswith(PREFIX)


def paths(dataset: str) -> list[Path]:
    """The files `files:<path>` names, sorted; a ConfigError naming the spec when none."""
    where = str(dataset)[len(PREFIX):]
    root = Path(where).expanduser()
    if root.is_dir():
        found = [p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    else:
        found = [Path(p) for p in glob.glob(str(root), recursive=True) if Path(p).is_file()]
    bad = sorted(str(p) for p in found if p.suffix not in SUFFIXES)
    if bad:
        raise ConfigError("data.dataset", dataset, f"{bad[0]} is neither plain text nor JSONL; files: takes "
                                                   f"{', '.join(SUFFIXES)} files")
    if not found:
        raise ConfigError("data.dataset", dataset, f"matches no {'/'.join(SUFFIXES)} file (files:<a file, a "
                                                   "directory or a glob>)")
    return sorted(p.absolute() for p in found)


def documents(files: list[Path], field: str) -> list[str]:
    """Every document of `files` in order (a .txt file's paragraphs, a JSONL file's lines' `field`)."""
    out = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".txt":
            out += [block.strip() for block in re.split(r"\n\s*\n", text) if block.strip()]
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ConfigError("data.dataset", f"{PREFIX}{path}", f"line {number} is not JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                keys = ", ".join(map(repr, record)) if isinstance(record, dict) else "not an object"
                raise ConfigError("data.text_field", field, f"{path} line {number} has no text under it ({keys})")
            out.append(record[field])
    return out


def split_slice(split: str, n: int, key: str = "data.train_split") -> slice:
    """The documents of `split` among `n` (TFDS's slicing syntax on the one split "train"); `key` names
    the config key it came from, for the error."""
    m = re.fullmatch(r"train(?:\[(-?\d*)(%?):(-?\d*)(%?)\])?", str(split).strip())
    if m is None:
        raise ConfigError(key, split, f"files: has one split, sliced as {SPLIT_FORMS}")
    a, a_pct, b, b_pct = m.groups() if m.group(1) is not None else ("", "", "", "")

    def at(value, pct):
        if value == "":
            return None
        return round(int(value) * n / 100) if pct else int(value)
    return slice(at(a, a_pct), at(b, b_pct))


def open_splits(dataset: str, field: str, splits: dict[str, str]) -> dict[str, list[dict]]:
    """{config key: that split's documents as records {field: text}} for {config key: split}, the files
    read once: what the text pipeline reads through favor.data.source.records, as it reads a TFDS source."""
    docs = documents(paths(dataset), field)
    out = {}
    for key, split in splits.items():
        chosen = docs[split_slice(split, len(docs), key)]
        if not chosen:
            raise ConfigError(key, split, f"holds none of the {len(docs)} documents of {dataset}; give more text or "
                                          f"another slice ({SPLIT_FORMS})")
        out[key] = [{field: d} for d in chosen]
    return out


def cache_name(dataset: str) -> str:
    """A name for what is cached from these files: each file's path, size and modification time."""
    h = hashlib.sha256()
    for p in paths(dataset):
        st = p.stat()
        h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return f"files-{h.hexdigest()[:12]}"
