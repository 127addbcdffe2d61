"""`python -m favor.bench lora [--presets mini,small,gpt2] [--ranks 8,16] [--kind favor#]`: what LoRA saves
in optimizer memory, against full fine-tuning, for a decoder.

For each decoder preset, the optimizer state a run holds (AdamW as configs/decoder_lm.py builds it:
favor.train.optim) for full fine-tuning, and with trainable="lora" at each rank on the query, key, value
and output projections (favor.uptrain.transfer.masked: the frozen parameters get no state). Every figure
is counted from the arrays' shapes and dtypes (jax.eval_shape of the optimizer's init on the model the
run builds): exact, not timed. Writes BENCHMARKS.md section `lora-memory` and bench/lora-memory.json.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
from flax import nnx

from favor import models
from favor.config import loading
from favor.bench import sections
from favor.bench.common import ints
from favor.models import lora
from favor.train import optim
from favor.train.loop import num_params, trained_params
from favor.uptrain import transfer

PRESETS = ("mini", "small", "gpt2")


def add_parser(sub):
    p = sub.add_parser("lora", help="optimizer memory of LoRA uptraining against full fine-tuning")
    p.add_argument("--presets", default=",".join(PRESETS), help="decoder presets (favor.config.presets)")
    p.add_argument("--ranks", default="8,16", help="LoRA ranks, comma-separated")
    p.add_argument("--kind", default="favor#", help="the attention kind of the uptrained model")
    p.add_argument("--out", default=".", help="where BENCHMARKS.md and bench/ are written")


def _bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def measure(preset, ranks, kind):
    """{params, full: optimizer bytes, lora: {rank: (trainable params, optimizer bytes)}} of one preset."""
    o = ml_collections.ConfigDict(loading.optim(lr=6e-4, schedule="cosine", warmup_steps=10, weight_decay=0.1))
    tx, _ = optim.make(o, 100)
    attention = {"kind": kind, "num_features": 256}
    full_model = nnx.eval_shape(lambda: models.get("decoder", preset, attention=attention, rngs=nnx.Rngs(0)))
    params = nnx.state(full_model, nnx.Param)
    row = {"preset": preset, "params": num_params(params),
           "param_bytes": _bytes(params), "full": _bytes(jax.eval_shape(tx.init, params)), "lora": {}}
    for rank in ranks:
        def build(rank=rank):
            model = models.get("decoder", preset, attention=attention, rngs=nnx.Rngs(0))
            lora.add(model, rank, 2.0 * rank, rngs=nnx.Rngs(1))
            return model
        p = nnx.state(nnx.eval_shape(build), nnx.Param)
        mask = transfer.trainable_mask(p, "lora")
        trained = trained_params(p, mask)
        row["lora"][str(rank)] = {"trainable": trained, "optimizer_bytes": _bytes(
            jax.eval_shape(transfer.masked(tx, mask).init, p))}
    return row


def main(args, flags, argv, parser):
    ranks = ints(parser, "--ranks", args.ranks)
    rows = [measure(p, ranks, args.kind) for p in args.presets.split(",")]
    meta = sections.machine(argv)
    mb = lambda b: f"{b / 2 ** 20:.1f} MB"
    lines = [sections.heading("lora-memory", meta), "",
             f"Optimizer state (AdamW: two moments per trained parameter, float32, and its step counts) of a "
             f"decoder uptrained as {args.kind}: full fine-tuning against LoRA on the query, key, value and output "
             f"projections (`uptrain.trainable=lora`), counted from the arrays' shapes (exact). Raw figures: "
             f"bench/lora-memory.json.", "",
             "| preset | parameters | full fine-tuning | " + " | ".join(f"LoRA r = {r}" for r in ranks) + " |",
             "|---|---|---|" + "---|" * len(ranks)]
    for r in rows:
        cells = [f"{mb(v['optimizer_bytes'])} ({v['optimizer_bytes'] / r['full']:.2%}; {v['trainable']:,} trained, "
                 f"{v['trainable'] / r['params']:.2%})" for v in r["lora"].values()]
        lines.append(f"| {r['preset']} | {r['params']:,} | {mb(r['full'])} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    sections.publish(args.out, "lora-memory", "\n".join(lines), {"meta": meta, "rows": rows})
