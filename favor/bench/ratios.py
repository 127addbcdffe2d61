"""`python -m favor.bench ratios`: forward (and forward+backward) times of several programs measured
round-robin, as ratios against targets (a named set or NUMERATOR,DENOMINATOR,TARGET;...)."""

from __future__ import annotations

import statistics

from favor import attention, runtime
from favor.bench import sections
from favor.bench.common import (B, D, H, M, compile_fn, counted_flops, layer_fn, packed_segments, round_robin,
                                setup, square_matmul)

# The long-sequence speed targets, each "numerator : denominator ≤ target". An entry is kind/mode; "matmul:kind/mode"
# is a square matmul with that entry's forward FLOP count (as in the attention table).
TARGETS = (("favor/bidir", "favor+/bidir", 2.5), ("hrf/bidir", "favor+/bidir", 2.5),
           ("favor+/bidir", "matmul:favor+/bidir", 2.0),
           *((f"{k}/causal", f"{k}/bidir", 1.5) for k in ("favor+", "simrf", "favor++", "favor#", "favor", "hrf",
                                                          "relu", "elu")),
           ("favor+@64/causal", "favor+/causal", 1.25), ("favor#@64/causal", "favor#/causal", 1.25))


# The costs of the kinds at one feature width (FAVOR++ and FAVOR# against FAVOR+, forward and
# forward+backward, bidirectional; trig and HRF): the targets of `--targets kinds`
KIND_TARGETS = tuple((f"{k}/bidir{g}", f"favor+/bidir{g}", t) for g in ("", "+grad")
                     for k, t in (("favor++", 1.15), ("favor#", 1.4), ("favor", 1.5), ("hrf", 1.5)))
# Causal as cheap as bidirectional: every linear kind's causal pass against its bidirectional one,
# forward and forward+backward, and the ±64 window hybrid against plain causal: the targets of
# `--targets causal`
CAUSAL_KINDS = ("favor+", "simrf", "favor++", "favor#", "favor", "hrf", "relu", "elu")
CAUSAL_TARGETS = (*((f"{k}/causal{g}", f"{k}/bidir{g}", 1.3) for g in ("", "+grad") for k in CAUSAL_KINDS),
                  *((f"{k}@64/causal{g}", f"{k}/causal{g}", 1.25) for g in ("", "+grad") for k in ("favor+", "favor#")))
# Packed documents ('+docs': rows of common.DOCUMENTS documents, segment ids) against the same rows as one
# sequence, forward and forward+backward. Causal with documents carries each document's own references and
# restarts (a pass with a few more reductions): ≤ 1.5; bidirectional with documents is two causal passes
# (a state per document would need the documents' count, which only the data knows) against one
# bidirectional pass: ≤ 3
DOCUMENT_KINDS = ("favor+", "favor#", "favor", "relu", "softmax", "favor+@64")
DOCUMENT_TARGETS = tuple((f"{k}/{m}+docs{g}", f"{k}/{m}{g}", 1.5 if m == "causal" else 3.0)
                         for g in ("", "+grad") for m in ("causal", "bidir") for k in DOCUMENT_KINDS)
TARGET_SETS = {"long": TARGETS, "kinds": KIND_TARGETS, "causal": CAUSAL_TARGETS, "documents": DOCUMENT_TARGETS}


def _entry(text):
    """'favor#/bidir' -> ('favor#', causal False, matmul False, grad False, docs False); the mode may end
    in '+docs' (packed rows: common.packed_segments) and '+grad' (the forward and backward pass, as a
    training step runs it)."""
    spec, _, mode = text.rpartition("/")
    grad = mode.endswith("+grad")
    mode = mode.removesuffix("+grad")
    docs = mode.endswith("+docs")
    mode = mode.removesuffix("+docs")
    if mode not in ("bidir", "causal") or not spec:
        raise ValueError(f"ratio entry {text!r}: expected kind/bidir or kind/causal, optionally +docs and "
                         f"+grad (or matmul:kind/mode)")
    matmul = spec.startswith("matmul:")
    kind = spec[len("matmul:"):] if matmul else spec
    try:
        attention.parse_spec(kind)
    except ValueError as e:
        raise ValueError(f"ratio entry {text!r}: {e}") from None
    if matmul and docs:
        raise ValueError(f"ratio entry {text!r}: a matmul has no documents")
    return kind, mode == "causal", matmul, grad, docs


def _forward(spec, length, causal, grad=False, docs=False):
    """(compiled forward — or forward and backward with `grad` —, its arguments, its FLOPs) of one kind,
    set up as `measure` does; `docs`: over packed documents (FLOPs not counted: no matmul twin takes them)."""
    attn, twin, args, stats = setup(spec, length, causal, docs)
    segments = packed_segments(length) if docs else None
    compiled, _, flops = compile_fn(layer_fn(attn, causal, stats, grad, segments), args)
    return compiled, args, None if docs else counted_flops(attn, twin, causal, args, stats, grad, flops)


def ratios(targets, length, rounds, seed=0):
    """Forward seconds of every entry of `targets`, timed round-robin: each round runs every program once
    in a fresh random order, so a burst of load on a shared machine falls on all of them alike. Per
    target: the ratio of the entries' minimum times and the median of the per-round ratios."""
    entries = sorted({e for n, d, _ in targets for e in (n, d)})
    parsed = {e: _entry(e) for e in entries}
    programs, flops = {}, {}          # entry -> (function, arguments, factor on its time)
    for e in entries:
        kind, causal, matmul, grad, docs = parsed[e]
        if not matmul:
            fn, args, flops[e] = _forward(kind, length, causal, grad, docs)
            programs[e] = (fn, args, 1.0)
    for e in entries:
        kind, causal, matmul, grad, _ = parsed[e]
        if matmul:
            twin = e[len("matmul:"):]
            programs[e] = square_matmul(flops[twin] if twin in flops else _forward(kind, length, causal, grad)[2])
    times = round_robin(programs, rounds, seed)
    rows = []
    for num, den, target in targets:
        per_round = [a / b for a, b in zip(times[num], times[den])]
        rows.append({"numerator": num, "denominator": den, "target": target,
                     "ratio_of_minima": min(times[num]) / min(times[den]),
                     "median_ratio": statistics.median(per_round),
                     "rounds_within_target": sum(r <= target for r in per_round) / len(per_round)})
    return rows, {e: {"min_ms": min(t) * 1e3, "median_ms": statistics.median(t) * 1e3} for e, t in times.items()}


def write_ratios(rows, times, length, rounds, out_dir, argv, section="attention-ratios"):
    meta = sections.machine(argv, length=length, rounds=rounds, B=B, H=H, D=D, M=M)
    lines = ["| ratio | target | ratio of minima | median of per-round ratios | rounds within | verdict |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['numerator']} : {r['denominator']} | ≤ {r['target']:g} | {r['ratio_of_minima']:.2f} | "
              f"{r['median_ratio']:.2f} | {r['rounds_within_target']:.0%} | {'met' if sections.met(r) else 'not met'} |" for r in rows]
    times_lines = ["| program | min ms | median ms |", "|---|---|---|"]
    times_lines += [f"| {e} | {t['min_ms']:.2f} | {t['median_ms']:.2f} |" for e, t in sorted(times.items())]
    body = (f"{sections.heading(section, meta)}\n\n"
            f"L = {length}, B = {B}, H = {H}, D = {D}, feature width F = {M} for every kind, float32, "
            f"{sections.where(meta)}. Forward passes ('+grad': "
            f"forward and backward) timed round-robin, {rounds} rounds, "
            f"each round every program once in a random order (load falls on all alike); the verdict reads the "
            f"median of the per-round ratios. 'matmul:' is a square matmul scaled to the kind's FLOP count. "
            f"Raw figures: bench/{section}.json.\n\n" + "\n".join(lines) + "\n\n" + "\n".join(times_lines))
    sections.publish(out_dir, section, body, {"meta": meta, "rows": rows, "times": times})


def add_parser(sub):
    r = sub.add_parser("ratios", help="speed ratios against targets, every program timed round-robin")
    r.add_argument("--length", type=int, default=8192)
    r.add_argument("--rounds", type=int, default=15)
    r.add_argument("--targets", default="long",
                   help="a named set (long: the long-sequence speed targets; kinds: the kinds' costs at one "
                        "width; causal: causal against bidirectional for every kind; documents: packed rows "
                        "against one sequence) or NUMERATOR,DENOMINATOR,TARGET;... with entries kind/bidir, "
                        "kind/causal, either +docs (packed documents) and +grad (forward and backward), or "
                        "matmul:kind/mode (default: %(default)s)")
    r.add_argument("--out", default=".")
    r.add_argument("--section", default="attention-ratios")


def parse_targets(text):
    """A named set or 'NUMERATOR,DENOMINATOR,TARGET;...' -> [(numerator, denominator, target)]."""
    if text in TARGET_SETS:
        return list(TARGET_SETS[text])
    targets = []
    for item in text.split(";"):
        fields = [x.strip() for x in item.split(",")]
        if len(fields) != 3:
            raise ValueError(f"target {item!r}: expected NUMERATOR,DENOMINATOR,TARGET or one of "
                             f"{', '.join(TARGET_SETS)}")
        _entry(fields[0]), _entry(fields[1])
        targets.append((fields[0], fields[1], float(fields[2])))
    return targets


def main(args, flags, argv, parser):
    try:
        targets = parse_targets(args.targets)
    except ValueError as e:
        parser.error(str(e))
    runtime.keep_host_pages()
    rows, times = ratios(targets, args.length, args.rounds)
    write_ratios(rows, times, args.length, args.rounds, args.out, argv, args.section)
    for row in rows:
        print(f"{row['numerator']:>20} : {row['denominator']:<20} {row['median_ratio']:.2f} "
              f"(min {row['ratio_of_minima']:.2f}, target {row['target']:g})")
