"""The one writer of benchmark results: a section of BENCHMARKS.md (replaced between its markers, so a
rerun updates it in place) and its raw figures as bench/<name>.json; what every section says about the
machine and the command that measured it; and the headline at the top of BENCHMARKS.md, every target the
sections measured, generated from their raw figures whenever one is published (so it never disagrees
with them: `python -m favor.bench headline` rewrites it alone)."""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from pathlib import Path

import jax

from favor import strings

INTRO = "# Benchmarks\n\nEvery figure is measured by `python -m favor.bench ...`.\n"


def replace_section(out_dir, section, body, at_top=False):
    """Writes `body` between the section's markers in place; a new section goes at the end, or with
    `at_top` right after the file's title and intro (before its first section)."""
    begin, end = strings.markers(section)
    md = Path(out_dir) / "BENCHMARKS.md"
    text = md.read_text() if md.exists() else INTRO
    replaced = strings.replace_between(text, section, body)
    body = f"{begin}\n{body}\n{end}"
    if replaced is not None:
        text = replaced
    elif at_top:
        found = [i for i in (text.find("\n## "), text.find("\n<!-- ")) if i >= 0]
        first = min(found) + 1 if found else len(text)
        text = text[:first] + body + "\n\n" + text[first:]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    md.write_text(text)


HEADLINE = "headline"


def met(row) -> bool:
    """A ratio target's verdict: the median of the per-round ratios within the target."""
    return row["median_ratio"] <= row["target"]


def _targets(name, payload):
    """(machine, met, [unmet descriptions]) of a section's raw figures, or None when it has no targets."""
    meta = payload.get("meta") or {}
    rows = [r for r in payload.get("rows") or [] if isinstance(r, dict) and {"target", "median_ratio"} <= set(r)]
    if rows:
        unmet = [f"{r['numerator']} : {r['denominator']} {r['median_ratio']:.2f} (≤ {r['target']:g})"
                 for r in rows if not met(r)]
        return where(meta), f"{len(rows) - len(unmet)} of {len(rows)}", unmet
    if payload.get("evals") and meta.get("target") is not None:       # a time-to-target training run
        first = meta.get("seconds_to_target")
        text = (f"{meta['metric']} < {meta['target']:g} first {first:.0f} s after the start" if first is not None
                else f"{meta['metric']} never below {meta['target']:g}")
        return where(meta), text, []
    return None


def headline(out_dir) -> str:
    """The headline table: one row per section of BENCHMARKS.md whose raw figures hold targets, in the
    file's order: the machine, how many targets the run met, and each one it did not."""
    text = (Path(out_dir) / "BENCHMARKS.md").read_text()
    names = re.findall(r"<!-- ([\w.-]+):begin -->", text)
    lines = ["## Targets (generated from the sections' raw figures: bench/<section>.json)", "",
             "Each row is one run of the section it names; ratios are the median of per-round ratios within "
             "that run, so rows from different runs or machines are not comparable with each other.", "",
             "| section | machine | targets met | not met: ratio (target) |", "|---|---|---|---|"]
    for name in names:
        path = Path(out_dir) / "bench" / f"{name}.json"
        if name == HEADLINE or not path.exists():
            continue
        got = _targets(name, json.loads(path.read_text()))
        if got:
            lines.append(f"| [{name}](#{name}) | {got[0]} | {got[1]} | {'; '.join(got[2]) or '–'} |")
    return "\n".join(lines)


def refresh_headline(out_dir):
    """Rewrites the headline between its markers, right after the file's title and intro."""
    if (Path(out_dir) / "BENCHMARKS.md").exists():
        replace_section(out_dir, HEADLINE, headline(out_dir), at_top=True)


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
    refresh_headline(out_dir)


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


SMOKE = ("*A `--quick` smoke run: CPU-sized settings that check the command runs end to end; its figures are "
         "not results.*")


def heading(section, meta):
    """'## section (`[XLA_FLAGS=...] command`)', and under it, when meta says the run was `--quick`, the line
    saying its figures are a smoke run's, not results."""
    flags = f"XLA_FLAGS='{meta['xla_flags']}' " if meta.get("xla_flags") else ""
    head = f"## {section} (`{flags}{meta['command']}`)"
    return head + "\n\n" + SMOKE if meta.get("quick") else head


def resolve_out(out, what, quick):
    """Where a subcommand writes BENCHMARKS.md and bench/: `out` when given; else a full run's "." (the
    committed figures, from the checkout's root), a --quick run's fresh temporary directory: a smoke run's
    figures must never replace the committed ones, nor be mistaken for them."""
    if out is not None:
        return out
    return tempfile.mkdtemp(prefix=f"favor-bench-{what}-quick-") if quick else "."


def said_quick(out, section):
    """The line a --quick run without --out ends with: where it wrote, and that the committed figures stay."""
    print(f"quick run: wrote {Path(out) / 'BENCHMARKS.md'} and {Path(out) / 'bench' / section}.* (a smoke run; "
          "the committed figures are untouched)", flush=True)
