"""Multi-query associative recall (favor.data.mqar, Zoology's construction) with a decoder of any kind.

    python train.py --config configs/mqar.py --workdir runs/mqar                          # softmax
    python train.py --config configs/mqar.py:kind=favor+,num_features=64 --workdir ...    # a state size
    python train.py --config configs/mqar.py:kind=favor+,window=8 ...                     # + a softmax band

The model is Zoology's small one: a 2-layer decoder, 64 wide (d_model 64), 2 heads, no dropout; the task
its MQAR at seq_len 64 with `pairs` key-value pairs (default 8) over a 256-token vocabulary. Zoology
uses 8192 and trains for 64 epochs of 100k examples; a CPU affords ~1500 steps of batch 64, in which
softmax learns the 256-token task (measured: 91 % recall at 4 pairs and 59 % at 8 after 750 steps)
and does not leave chance with 2048 tokens (2 % after 600 steps). AdamW at 3e-3, cosine, `steps`
steps of batch 64. Accuracy is the fraction of queried values predicted exactly.

State size: softmax keeps every key (its state grows with the sequence); a linear kind keeps its feature
sums and their per-feature stabiliser, 2 layers × heads × F × (head dim + 2) numbers whatever the
length, so `num_features` sets it; `window` adds the last w + 1 keys exactly.

Args: kind, num_features, window, pairs, seq_len, vocab, steps, batch, runlocal; the sweep's seeds, widths
(F values, "/"-separated), kinds (trained at every width), others (kinds trained at the middle width only,
so that every kind appears without tripling the runs), bands (window sizes for FAVOR+ at the middle width).

    python launch/sweep_local.py --config configs/mqar.py:seeds=3 --workdir runs/mqar --parallel 2
"""

from favor import strings
from favor.config import blocks

SWEEP_KINDS = ("favor+", "favor++", "favor#", "elu")


def _args(arg):
    return blocks.parse_arg(arg, kind="softmax", num_features=64, window=0, pairs=8, seq_len=64, vocab=256,
                               steps=1500, batch=64, runlocal=False, seeds=3, widths="16/64/256",
                               kinds="/".join(SWEEP_KINDS), others="", bands="8")


def sweep(arg=None):
    """Recall against state size: softmax; each random-feature kind of `kinds` at every width F of `widths`
    (its state: F·(head dim + 2) numbers per head and layer) and each of `others` at the middle width only,
    sign-indefinite kinds with queries and keys on the sphere (qk_norm=l2); ReLU/ELU once (F = head dim);
    FAVOR+ at the middle width with each exact band of `bands`; seed by seed."""
    args = _args(arg)
    widths = sorted(set(strings.positive_ints("widths", args.widths)))
    if int(args.seeds) < 1:
        raise ValueError(f"widths={args.widths}, seeds={args.seeds}: expected positive numbers")
    kind, width, band = "model.attention.kind", "model.attention.num_features", "model.attention.window"
    settings = [{kind: "softmax"}]
    from favor import attention        # the kinds' registry: JAX, which writing a config never needs
    from favor import sweeps
    allowed = [n for n in attention.names() if n != "softmax"]
    kinds = blocks.values("kinds", args.kinds, allowed)
    others = [k for k in blocks.values("others", args.others, allowed) if k not in kinds]
    for k in list(kinds) + others:
        ws = widths if k in kinds else [widths[len(widths) // 2]]
        # sign-indefinite kinds (trig, HRF) on the sphere, as favor advises: unnormalised they barely train
        settings += [{kind: k}] if k in ("relu", "elu") else [sweeps.as_advised({kind: k, width: w}) for w in ws]
    settings += [{kind: "favor+", width: widths[len(widths) // 2], band: int(b)}
                 for b in strings.positive_ints("bands", args.bands, nonempty=False)]
    yield from sweeps.seed_by_seed(settings, range(int(args.seeds)))


def get_config(arg=None):
    args = _args(arg)
    for name in ("num_features", "pairs", "seq_len", "vocab", "steps", "batch"):
        if int(args[name]) < 1:
            raise ValueError(f"{name}={args[name]}: expected a positive integer")
    if int(args.window) < 0:
        raise ValueError(f"window={args.window}: expected 0 (none) or a positive number of tokens")
    steps = int(args.steps)
    c = blocks.run_config(total_steps=steps, batch_size=int(args.batch), eval_batch_size=256, every=max(steps // 4, 1),
                             keep_checkpoints=1)
    c.data = {"name": "mqar", "vocab_size": int(args.vocab), "seq_len": int(args.seq_len),
              "num_pairs": int(args.pairs), "power_a": 0.01, "random_non_queries": True, "num_train": 100_000,
              "num_eval": 1_000}
    c.task = {"name": "causal_lm"}
    c.model = {"name": "decoder", "preset": "tiny", "vocab_size": int(args.vocab), "hidden": 64, "num_layers": 2,
               "heads": 2, "mlp_dim": 256, "max_positions": int(args.seq_len), "init_from": "",
               "attention": blocks.attention(args.kind, num_features=int(args.num_features),
                                                window=int(args.window))}
    c.optim = blocks.optim(lr=3e-3, schedule="cosine", warmup_steps=min(200, steps // 10), weight_decay=0.1)
    if args.runlocal:
        c.data.update(vocab_size=128, seq_len=32, num_pairs=4, num_train=512, num_eval=64)
        c.model.update(vocab_size=128, hidden=32, mlp_dim=64, max_positions=32)
        c.model.attention.num_features = 16
        c.total_steps, c.batch_size, c.eval_batch_size = 30, 16, 32
        c.checkpoint_every, c.eval_every, c.log_every = 30, 30, 10
    return c
