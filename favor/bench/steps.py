"""`python -m favor.bench steps`: a config's training step for several kinds, timed round-robin."""

from __future__ import annotations

import random
import statistics
import time

import jax

from favor import attention
from favor.bench import sections

STEP_KINDS = ("softmax", "relu", "elu", "favor", "favor+", "favor++", "favor#", "hrf", "simrf")


def train_steps(config_spec, kinds, rounds, seed=0, flags=()):
    """Seconds per training step of `config_spec` (configs/<file>.py[:args], with `flags` as
    --config.key=value overrides) for each attention kind: every kind's jitted step (data, model, shardings
    and optimizer as train.py builds them, one fixed batch) run once per round in a fresh random order, so
    load on a shared machine falls on all alike. Returns {kind: [seconds per round]}."""
    # the training stack (TensorFlow's data pipelines among it) loads when this subcommand runs, so
    # the other subcommands start without it
    from favor import sharding, job
    from favor.config import loading
    programs = {}
    for kind in kinds:
        config = loading.load(config_spec)
        for flag in flags:
            loading.apply_flag(config, flag)
        with config.unlocked():
            config.model.attention.kind = kind
        job.validate(config)
        source, task = job.make_data(config)
        model = job.make_model(config, source)
        layout = job.make_layout(model, sharding.make_mesh(config.mesh), config.sharding_rules, source)
        step_fn = job.make_train_step(config, model, task, layout)
        state = job.initial_state(config, model, layout)
        batch = layout.global_batch(next(iter(source.train_batches(int(config.batch_size), 0, int(config.seed)))))
        state, _ = step_fn(state, batch)                                   # compile and warm
        jax.block_until_ready(state)
        programs[kind] = [step_fn, state, batch]
    times = {kind: [] for kind in kinds}
    order, rnd = list(kinds), random.Random(seed)
    for _ in range(rounds):
        rnd.shuffle(order)
        for kind in order:
            step_fn, state, batch = programs[kind]
            t0 = time.perf_counter()
            state, metrics = step_fn(state, batch)
            jax.block_until_ready((state, metrics))
            times[kind].append(time.perf_counter() - t0)
            programs[kind][1] = state
    return times


def write_steps(times, config_spec, rounds, out_dir, argv, reference="favor+", target=2.0, section="train-steps"):
    """The per-kind step times against `reference`'s (median of per-round ratios, ≤ `target` met)."""
    meta = sections.machine(argv, config=config_spec, rounds=rounds)
    rows = []
    for kind, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, times[reference])) if reference in times else None
        rows.append({"kind": kind, "min_ms": min(t) * 1e3, "median_ms": statistics.median(t) * 1e3,
                     "steps_per_second": 1.0 / statistics.median(t), "ratio": ratio})
    verdict = lambda r: "—" if r["ratio"] is None or r["kind"] in ("softmax", "relu", "elu") else (
        "met" if r["ratio"] <= target else "not met")
    lines = [f"| kind | ms per step (min / median) | steps/s | time / {reference}'s | ≤ {target:g}× |",
             "|---|---|---|---|---|"]
    fmt = lambda x: "—" if x is None else f"{x:.2f}"
    lines += [f"| {r['kind']} | {r['min_ms']:.1f} / {r['median_ms']:.1f} | {r['steps_per_second']:.1f} | "
              f"{fmt(r['ratio'])} | {verdict(r)} |" for r in rows]
    body = (f"{sections.heading(section, meta)}\n\n"
            f"`{config_spec}`'s training step (forward, backward, optimizer; the config's batch) for each kind, "
            f"{sections.where(meta)}: every kind's step once per round "
            f"in a random order, {rounds} rounds; the ratio is the median of the per-round ratios to "
            f"{reference}'s step. Raw figures: bench/{section}.json.\n\n" + "\n".join(lines))
    sections.publish(out_dir, section, body, {"meta": meta, "rows": rows, "times": times})
    return rows


def add_parser(sub):
    st = sub.add_parser("steps", help="a config's training step for every kind, timed round-robin (flags after --)")
    st.add_argument("--config", default="configs/default.py", help="configs/<file>.py[:args] (default: %(default)s)")
    st.add_argument("--kinds", default=",".join(STEP_KINDS))
    st.add_argument("--rounds", type=int, default=30)
    st.add_argument("--out", default=".")
    st.add_argument("--section", default="train-steps")


def main(args, flags, argv, parser):
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in attention.names()]
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)}; valid: {', '.join(attention.names())}")
    times = train_steps(args.config, kinds, args.rounds, flags=flags)
    for r in write_steps(times, args.config, args.rounds, args.out, argv, section=args.section):
        print(f"{r['kind']:>8}: {r['median_ms']:7.1f} ms/step" +
              ("" if r["ratio"] is None else f", {r['ratio']:.2f}× favor+"))
