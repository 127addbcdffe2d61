"""What a reproduction returns and how it is written: a table with the paper's numbers beside
favor's (Markdown), the raw figures (JSON) and the plot (PNG)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass
class Report:
    """title: one line; columns/rows: the table (rows of plain values; None prints as '–');
    notes: paragraphs under the table (where favor agrees with the paper and where not, and why);
    figures: the raw numbers, JSON-able; plot(fig): draws the figure on a matplotlib Figure;
    checks: (claim, holds) pairs, the paper's claims tested on favor's figures (the tests require them
    to hold); comparisons: (text, verdict) pairs, verdict one of VERDICTS: a paper's claim set beside
    favor's figure where favor may disagree, reported rather than required."""
    title: str
    protocol: str
    columns: list[str]
    rows: list[list[Any]]
    figures: dict
    plot: Callable[[Any], None]
    notes: list[str] = dataclasses.field(default_factory=list)
    checks: list[tuple[str, bool]] = dataclasses.field(default_factory=list)
    comparisons: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    figsize: tuple[float, float] = (11.0, 4.2)
    seconds: float = 0.0

    def markdown(self, quick=False):
        lines = [f"## {self.title}", ""]
        if quick:
            lines += [SMOKE, ""]
        lines += [self.protocol.strip(), ""]
        lines += ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in self.rows]
        if self.checks:
            lines += ["", "Claims of the paper, checked on these figures:", ""]
            lines += [f"- {'✓' if ok else '✗'} {claim}" for claim, ok in self.checks]
        if self.comparisons:
            lines += ["", "The paper's claims beside favor's figures (✓ agrees, ≈ within noise, ✗ disagrees):", ""]
            lines += [f"- {VERDICTS[v]} {v}: {text}" for text, v in self.comparisons]
        if self.notes:
            lines += [""] + [n.strip() + "\n" for n in self.notes]
        lines += ["", f"Computed in {self.seconds:.0f} s."]
        return "\n".join(lines).rstrip() + "\n"


SMOKE = ("*A `--quick` smoke run: a reduced protocol, not the paper's, that checks the command runs end to end; "
         "its figures are not results (the committed outputs under repro/ come from the full protocol).*")

VERDICTS = {"agrees": "✓", "within noise": "≈", "disagrees": "✗"}


def verdict(z, margin=2.0):
    """'agrees' when the paper's direction holds beyond `margin` standard errors (z = difference in the
    paper's direction / its SE), 'disagrees' when the opposite does, else 'within noise'."""
    return "agrees" if z > margin else "disagrees" if z < -margin else "within noise"


def _cell(c):
    if c is None:
        return "–"
    if isinstance(c, (float, np.floating)):
        c = float(c)
        if not math.isfinite(c):
            return str(c)
        if c != 0 and (abs(c) >= 1e5 or abs(c) < 1e-3):
            return f"{c:.3g}"
        return f"{c:.4g}"
    return str(c)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else str(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def resolve_out(out, name, quick):
    """Where a run writes: `out` when given; else a full run's repro/<name> (where the committed outputs
    live, from the checkout's root), a --quick run's fresh temporary directory: a smoke run's figures
    must never replace the committed ones, nor be mistaken for them."""
    if out is not None:
        return out
    return tempfile.mkdtemp(prefix=f"favor-repro-{name}-quick-") if quick else os.path.join("repro", name)


def write(result: Report, out_dir: str, name: str, quick=False):
    """<out>/<name>.{png,md,json}; each written to a temporary name and renamed, so an interrupted
    run never leaves a half-written file under the final name."""
    # plotting loads matplotlib only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f"{name}.{ext}") for ext in ("png", "md", "json")}
    fig = plt.figure(figsize=result.figsize, dpi=110)
    try:
        result.plot(fig)
        fig.tight_layout()
        fig.savefig(paths["png"] + ".tmp.png")
    finally:
        plt.close(fig)
    os.replace(paths["png"] + ".tmp.png", paths["png"])
    for ext, text in (("md", result.markdown(quick)),
                      ("json", json.dumps(_jsonable({"title": result.title, "quick": quick,
                                                     "seconds": result.seconds,
                                                     "columns": result.columns, "rows": result.rows,
                                                     "checks": result.checks,
                                                     "comparisons": result.comparisons, "figures": result.figures}),
                                          indent=1))):
        with open(paths[ext] + ".tmp", "w") as f:
            f.write(text)
        os.replace(paths[ext] + ".tmp", paths[ext])
    return list(paths.values())
