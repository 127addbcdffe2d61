"""The one writer of benchmark results: a section of BENCHMARKS.md (replaced between its markers, so a
rerun updates it in place) and its raw figures as bench/<name>.json; and what every section says about
the machine and the command that measured it."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import jax


def markers(section):
    return f"<!-- {section}:begin -->", f"<!-- {section}:end -->"


def replace_section(out_dir, section, body):
    begin, end = markers(section)
    body = f"{begin}\n{body}\n{end}"
    md = Path(out_dir) / "BENCHMARKS.md"
    text = md.read_text() if md.exists() else "# Benchmarks\n\nEvery figure is measured by `python -m favor.bench ...`.\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + body + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    md.write_text(text)


def write_json(out_dir, name, payload):
    """bench/<name>.json under `out_dir` (made if missing); returns its path."""
    path = Path(out_dir) / "bench" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return path


def publish(out_dir, section, body, payload, json_name=None):
    """The raw figures (bench/<json_name or section>.json), then the Markdown section."""
    write_json(out_dir, json_name or section, payload)
    replace_section(out_dir, section, body)


def machine(argv, **extra):
    """What every figure depends on: jax, backend, cores, the command (and XLA_FLAGS) that ran it."""
    return {"jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
            "device": jax.devices()[0].device_kind,
            "machine": platform.machine(), "command": "python -m favor.bench " + " ".join(argv),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), **extra}


def where(meta):
    """'cpu (2 cores), jax 0.10.2' or 'gpu (NVIDIA H100 80GB HBM3; 16 cores), jax 0.11.2': the machine a
    section's figures come from, as every section's text names it."""
    device = "" if meta["backend"] == "cpu" or not meta.get("device") else f"{meta['device']}; "
    return f"{meta['backend']} ({device}{meta['cpu_count']} cores), jax {meta['jax']}"


def heading(section, meta):
    """'## section (`[XLA_FLAGS=...] command`)'."""
    flags = f"XLA_FLAGS='{meta['xla_flags']}' " if meta.get("xla_flags") else ""
    return f"## {section} (`{flags}{meta['command']}`)"
