"""README's "Choosing a kernel", written from favor's committed measurements: `python -m favor.repro.guide`
rewrites the section between its markers from repro/*/<name>.json and bench/<section>.json; `--check`
exits 1 when the README's section is not what those files give (the suite runs it, so the guide's
numbers cannot drift from the measurements they cite).

Every figure in the section is read here from a committed output; the prose around it says what the
figures mean and is kept next to the code that reads them."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from favor import strings
from favor.repro import trained

ROOT = Path(__file__).resolve().parents[2]
SECTION = "choosing-a-kernel"           # README's markers: favor.strings.markers


class Missing(ValueError):
    """A committed output the guide reads is absent or lacks a figure it cites."""


def _json(path: Path) -> dict:
    if not path.exists():
        raise Missing(f"{path}: missing (the guide cites it)")
    return json.loads(path.read_text())


def repro(root: Path, name: str) -> dict:
    return _json(root / "repro" / name / f"{name}.json")["figures"]


def bench(root: Path, section: str) -> dict:
    return _json(root / "bench" / f"{section}.json")


def _get(table: dict, key: str, where: str):
    if key not in table:
        raise Missing(f"{where}: no {key!r} (has {', '.join(map(str, table))})")
    return table[key]


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _stat(values) -> trained.Stat:
    return trained.Stat(tuple(float(v) for v in values))


def _figures(values) -> dict:
    """{"values", "mean", "sd"} of a setting's seeds, as the reproductions' JSON holds them."""
    stat = _stat(values)
    return {"values": stat.values, "mean": stat.mean, "sd": stat.sd}


def _within(settings: dict, ref: str) -> list[str]:
    """The settings within 2 SE of `ref` or above it (favor.repro.trained's rating)."""
    base = _stat(settings[ref]["values"])
    return [k for k, v in settings.items()
            if k != ref and trained.rate(_stat(v["values"]), base)[0] != "disagrees"]


def scratch_rows(root: Path) -> list[list[str]]:
    runs = bench(root, "ablation-default")["rows"]
    values = {}
    for r in runs:
        if r.get("final") is not None:
            key = (r["settings"]["model.attention.kind"], r["settings"]["model.attention.qk_norm"])
            values.setdefault(key, []).append(r["final"])
    l2 = {k: _figures(v) for (k, n), v in values.items() if n == "l2"}
    none = {k: statistics.fmean(v) for (k, n), v in values.items() if n == ""}
    tied = _within(l2, "softmax")
    below = sorted((k for k in l2 if k not in tied and k != "softmax"), key=lambda k: -l2[k]["mean"])
    named = lambda ks: ", ".join(f"{k} {pct(l2[k]['mean'])}" for k in ks) or "none"
    digits = ["**Classification from scratch, short sequences** (the default job's digits ViT, `qk_norm=l2`)",
              f"softmax {pct(l2['softmax']['mean'])}; within 2 SE of it or above: {named(tied)}; below: {named(below)}; "
              f"trig and HRF without `qk_norm` {pct(none['favor'])} and {pct(none['hrf'])}",
              _tied_advice(l2, tied) + "; trig and HRF only with `qk_norm=l2` (favor warns without it)",
              "[ablation](#the-kernel-ablation)"]
    lo_ = repro(root, "listops-kernels")
    s = lo_["settings"]
    tied = [k for k in _within(s, "softmax") if "bag of tokens" not in k]
    below = [k for k in s if k not in tied and k not in ("softmax",) and "bag of tokens" not in k]
    named = lambda ks: ", ".join(f"{k} {pct(s[k]['mean'])}" for k in ks) or "none"
    bag = _get(s, "bag of tokens (no attention)", "listops-kernels")
    listops = [f"**A task attention decides, from scratch** (ListOps, {lo_['window']} tokens)",
               f"softmax {pct(s['softmax']['mean'])}, no attention {pct(bag['mean'])}; within 2 SE of softmax or above: "
               f"{named(tied)}; below: {named(below)}",
               _tied_advice(s, tied),
               "[listops-kernels](repro/listops-kernels/listops-kernels.md)"]
    return [digits, listops]


def _tied_advice(s: dict, tied: list[str]) -> str:
    """The tied kinds whose seeds agree (sd ≤ 3 points, a rule of this guide), best mean first; those tied
    only through a wide seed spread are named as such."""
    steady = sorted((k for k in tied if s[k]["sd"] <= 0.03), key=lambda k: -s[k]["mean"])
    wide = [k for k in tied if k not in steady]
    text = (", ".join(steady) + " (they tie: choose by cost)") if steady else "softmax"
    if wide:
        text += "; " + ", ".join(f"{k} (sd {100 * s[k]['sd']:.1f} points)" for k in wide) + \
            " tie only through their seeds' spread"
    return text


def _gap_text(final: dict, others: list[str]) -> str:
    best = max(others, key=lambda k: final[k]["mean"])
    gap = 100 * (final["softmax"]["mean"] - final[best]["mean"])
    return f"softmax (the best other, {best}, is {gap:.1f} points below)"


def _side(figures: dict, side: str) -> tuple[dict, int]:
    f = _get(figures, side, "uptrain-kernels")
    return f["settings"], int(f["uptrain"]["steps"])


def uptrain_rows(root: Path) -> list[list[str]]:
    f = repro(root, "uptrain-kernels")
    rows = []
    for side, what in (("vit", "**Uptraining a softmax classifier** (digits ViT)"),
                       ("bert", "**Uptraining a softmax BERT** (masked-LM, docstrings)")):
        if side not in f:
            raise Missing(f"uptrain-kernels: no {side!r} side")
        settings, steps = _side(f, side)
        day0 = {k: _figures(v["day0"]) for k, v in settings.items()}
        final = {k: _figures(v["final"]) for k, v in settings.items()}
        others = [k for k in settings if k != "softmax"]
        best0 = max(others, key=lambda k: day0[k]["mean"])
        worst0 = min(others, key=lambda k: day0[k]["mean"])
        serve = _within(day0, "softmax")
        tied = _within(final, "softmax")
        if not serve:
            serve_text = (f"no kind matches softmax at day 0 (the best, {best0}, is "
                          f"{100 * (day0['softmax']['mean'] - day0[best0]['mean']):.1f} points below)")
        elif len(serve) == len(others):
            serve_text = "day 0 does not separate the kinds (all within 2 SE of softmax)"
        else:
            serve_text = f"to serve without training: {', '.join(serve)}"
        rows.append([what,
                     f"day 0 (no step): {best0} {pct(day0[best0]['mean'])} … {worst0} {pct(day0[worst0]['mean'])} "
                     f"against softmax's {pct(day0['softmax']['mean'])}; after {steps} steps within 2 SE of softmax "
                     f"({pct(final['softmax']['mean'])}) or above: {', '.join(tied) or 'none'}",
                     f"{serve_text}; after {steps} steps: " + (_tied_advice(final, tied) if tied else
                                                             _gap_text(final, others)),
                     "[uptrain-kernels](repro/uptrain-kernels/uptrain-kernels.md)"])
    return rows


def _band_of(label: str) -> int:
    """The band in a setting's label ("FAVOR+ + band 8" -> 8)."""
    return int(label.rsplit("band", 1)[1].split()[0])


def causal_rows(root: Path) -> list[list[str]]:
    lin = repro(root, "linearize")
    source = lin["source"]
    s = lin["settings"]
    full = {k.split(" | ")[0]: v for k, v in s.items() if k.endswith("| full FT")}
    mean = lambda v, key: statistics.fmean(v[key])
    band = {k: v for k, v in full.items() if "+ band" in k and not k.startswith(("Hedgehog", "T2R", "ELU"))}
    alone = _get(full, next((k for k in full if k.startswith("band")), "band alone"), "linearize")
    unbanded = {k: v for k, v in full.items() if "band" not in k}
    best_free = min(unbanded, key=lambda k: mean(unbanded[k], "final"))
    rf_free = {k: v for k, v in unbanded.items() if k.startswith("FAVOR")}
    best_rf = min(rf_free, key=lambda k: mean(rf_free[k], "final"))
    ppl = lambda v: f"{mean(v, 'final'):.1f}"
    rec = lambda v: f"{mean(v, 'recall'):.1f} %"
    band_ppl = sorted(mean(v, "final") for v in band.values())
    band_rec = sorted(mean(v, "recall") for v in band.values())
    band_size = _band_of(next(iter(band)))
    linearize = ["**Linearizing a causal LM** (a softmax decoder continued by full fine-tuning)",
                 f"source perplexity {source['perplexity']:.1f}, recall {pct(source['recall'])}; random-feature "
                 f"kinds + a band of {band_size}: {band_ppl[0]:.1f}–{band_ppl[-1]:.1f}, recall {band_rec[0]:.1f}–"
                 f"{band_rec[-1]:.1f} %; the band alone {ppl(alone)} but recall {rec(alone)}; without a band the "
                 f"best is {best_free} ({ppl(unbanded[best_free])}), the best random kind {best_rf} "
                 f"({ppl(unbanded[best_rf])})",
                 f"any random-feature kind with `window={band_size}` (`favor+@{band_size}`); without a band, {best_free}",
                 "[linearize](repro/linearize/linearize.md)"]
    mq = repro(root, "mqar-kernels")
    ms = mq["settings"]
    lin_best = max((k for k in ms if k != "softmax"), key=lambda k: ms[k]["mean"])
    state = mq["state_numbers"]
    mqar = [f"**Recall from scratch** (MQAR, {mq['pairs']} key-value pairs)",
            f"softmax {pct(ms['softmax']['mean'])}; the best linear setting, {lin_best}, "
            f"{pct(ms[lin_best]['mean'])} ± {100 * ms[lin_best]['sd']:.1f} (sd over seeds) with {state[lin_best]:,} "
            f"state numbers against softmax's {state['softmax']:,}",
            "softmax (or hybrid layers) where exact recall matters: no linear kind came close",
            "[mqar-kernels](repro/mqar-kernels/mqar-kernels.md)"]
    return [linearize, mqar]


def speech_row(root: Path) -> list[str]:
    sp = repro(root, "speech-kernels")
    s = sp["settings"]
    floor = next(k for k in s if k.startswith("no attention"))
    lo = min((k for k in s if k not in (floor, "softmax")), key=lambda k: s[k]["mean"])
    return ["**Speech** (Conformer-CTC, synthetic speech)",
            f"WER: softmax {pct(s['softmax']['mean'])}, no attention {pct(s[floor]['mean'])}, the best kind {lo} "
            f"{pct(s[lo]['mean'])}",
            "not known: at this size the task does not need attention, so it rates no kind",
            "[speech-kernels](repro/speech-kernels/speech-kernels.md)"]


def _accel(root, section, grad, kind):
    rows = bench(root, section)["rows"]
    out = {}
    for r in rows:
        dtype, _, causal, g, length, _ = r["config"]
        res = r["results"].get(kind, {})
        if g == grad and "ratio" in res:
            out[int(length)] = (bool(causal), float(res["ratio"]))
    return out


def speed_rows(root: Path) -> list[list[str]]:
    bidir = {n: r for n, (c, r) in _accel(root, "accel-nvidia-h200-segments", True, "favor+/pallas-bf16").items()
             if not c}
    causal = {n: r for n, (c, r) in _accel(root, "accel-nvidia-h200-tuned-causal", True,
                                          "favor+/pallas-bf16").items() if c}
    if not bidir or not causal:
        raise Missing("accel-nvidia-h200-segments / -tuned-causal: no pallas-bf16 forward+backward rows")
    k = lambda n: f"{n // 1024}K"

    def crossing(d):
        """Where the kernel starts to beat softmax: 'at or below L' when it already does at the shortest
        length measured, else 'between A and B' (the last length it loses and the first it wins)."""
        wins = [n for n in sorted(d) if d[n] < 1.0]
        if not wins:
            return None, f"slower at every length measured (up to {k(max(d))})"
        first = wins[0]
        losing = [n for n in sorted(d) if n < first]
        if not losing:
            return first, f"faster from {k(first)}, the shortest length measured"
        return first, f"crosses over between {k(losing[-1])} ({d[losing[-1]]:.2f}× its time) and {k(first)} ({d[first]:.2f}×)"

    meta = bench(root, "accel-nvidia-h200-segments")["meta"]
    dtype = bench(root, "accel-nvidia-h200-segments")["rows"][0]["config"][0]
    top_b, top_c = max(bidir), max(causal)
    first_b, text_b = crossing(bidir)
    first_c, text_c = crossing(causal)
    use = (f"`impl=pallas-{'bf16' if dtype == 'bfloat16' else 'highest'}` at {k(first_b)} and beyond bidirectional, "
           f"{k(first_c)} and beyond causal; softmax below the crossings" if first_b and first_c
           else "softmax at the lengths measured")
    gpu = [f"**Long sequences on a GPU** (FAVOR+, {meta['device']}, {dtype}, forward+backward)",
           f"against cuDNN flash attention: bidirectional {text_b}, {1 / bidir[top_b]:.0f}× faster at {k(top_b)}; "
           f"causal {text_c}, {1 / causal[top_c]:.1f}× faster at {k(top_c)}",
           use, "[fused kernel](#the-fused-kernel-impl-and-speed-on-accelerators)"]
    gen = bench(root, "generate")["results"]
    longest = max(gen, key=int)
    g = gen[longest]
    preset = _get(bench(root, "generate")["meta"], "preset", "generate")
    decode = [f"**Decoding** (the `{preset}` decoder, CPU, prompt {int(longest):,})",
              f"FAVOR+ {g['favor+']['tokens_per_s'] / g['softmax']['tokens_per_s']:.0f}× softmax's tokens/s, "
              f"state {g['favor+']['state_bytes'] / 2 ** 20:.2f} MiB against a {g['softmax']['state_bytes'] / 2 ** 20:.0f} MiB "
              "cache (constant in the length)",
              "any linear kind when prompts are long; softmax's cache grows with each token",
              "[decoding](#decoder-language-models-and-generation)"]
    return [gpu, decode]


def unknown(root: Path) -> str:
    rows = bench(root, "causal-ratios")["rows"]
    fwd = [r["median_ratio"] for r in rows if r["numerator"].endswith("/causal") and r["denominator"].endswith("/bidir")]
    if not fwd:
        raise Missing("causal-ratios: no causal : bidirectional forward rows")
    return ("- **Not yet known here**: GLUE-scale fine-tuning (the BERT figures are a small model's), TPU speed "
            "(the Mosaic kernels are compiled for TPU in the tests, not timed on a TPU), a causal pass as cheap as "
            "the bidirectional one on CPU "
            f"({min(fwd):.1f}–{max(fwd):.1f}× forward at L = 8192, `causal-ratios`), which kind wins once a model "
            "trains for days rather than minutes.\n" + YOURS)


YOURS = ("- **Your model**: `python -m favor.tools.advise --workdir <run | hf:dir>` measures day 0, the attention "
           "error per layer, the cost at your length and the decoding state on your own checkpoint, and ranks them "
           "(below).")


def section(root: Path = ROOT) -> str:
    rows = scratch_rows(root) + uptrain_rows(root) + causal_rows(root) + [speech_row(root)] + speed_rows(root)
    out = ["Each line is one situation, what favor measured for it and what that suggests; every figure is "
           "read from the committed output it links (`python -m favor.repro.guide` writes this section).", "",
           "| situation | favor measured | so use | from |", "|---|---|---|---|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out + ["", unknown(root)])


def write(readme: Path, text: str) -> bool:
    """Put `text` between the section's markers; True when the file changed."""
    old = readme.read_text()
    new = strings.replace_between(old, SECTION, text)
    if new is None:
        raise Missing(f"{readme.name}: no {' … '.join(strings.markers(SECTION))} markers")
    if new != old:
        readme.write_text(new)
    return new != old


def current(readme: Path) -> str:
    found = strings.between(readme.read_text(), SECTION)
    if found is None:
        raise Missing(f"{readme.name}: no {' … '.join(strings.markers(SECTION))} markers")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m favor.repro.guide", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if README's section differs from the outputs'")
    p.add_argument("--root", default=str(ROOT), help="the checkout whose outputs and README are read")
    args = p.parse_args(argv)
    root = Path(args.root)
    try:
        text = section(root)
        if args.check:
            if current(root / "README.md") != text:
                print("README.md: 'Choosing a kernel' is not what the committed outputs give; run "
                      "`python -m favor.repro.guide`", file=sys.stderr)
                return 1
            print("README.md: 'Choosing a kernel' matches the committed outputs")
            return 0
        changed = write(root / "README.md", text)
    except Missing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("README.md: 'Choosing a kernel' " + ("rewritten" if changed else "unchanged"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
