"""The embedded default job: a ViT with FAVOR++ attention on scikit-learn's handwritten digits.

    python train.py --config configs/default.py --workdir runs/default        (= make train)

Each 8×8 image is 64 one-pixel patches plus a class token (L = 65). Expected: test accuracy ≥ 95 %
in under 5 minutes on 2 CPU cores (see README for the measured figure and the softmax baseline:
`--config.model.attention.kind=softmax`). Variants in the arg:

    configs/default.py:runlocal          tiny and fast (the test suite's run)
    configs/default.py:kind=favor#       any attention kind (also: --config.model.attention.kind=favor#)
    configs/default.py:kind=favor#,variant=saderf   kind-specific options go in the arg

`sweep()` yields the kernel ablation, every kind × `seeds` seeds, as override dicts:

    python launch/sweep_local.py --config configs/default.py --workdir runs/ablation
    python -m favor.tools.report runs/ablation --plot runs/ablation/report.png
    configs/default.py:seeds=3           three seeds per kind (get_config ignores the sweep's args)
    configs/default.py:seeds=3,qk_norms=none/l2   every kind with and without queries and keys on a sphere
    configs/default.py:kinds=favor+/hrf,redraws=step/fixed/every:100,qk_norm=l2   the redraw study
    configs/default.py:kinds=favor#:sderf/favor#:saderf   kinds as specs, kind[:variant][@window]

A sweep arg's list separates its values by "/" ("," separates the args, and "+" is in kind names).
"""

import ml_collections

from favor.config import blocks

# kind-specific attention options: empty / False means "the kind's own default" (the spec options,
# variant / lambda_ / features, are in every attention block at "", the kind's own; the others go into the
# block only when the arg names them, so each kind keeps its default unless asked)
KIND_OPTIONS = dict(variant="", lambda_="", features="", importance_sampling=False, antithetic=False)
# the sweep's axes (get_config ignores them): "/"-separated values; "none" is qk_norm ""
SWEEP_ARGS = dict(seeds=2, kinds="", qk_norms="", redraws="")


def _args(arg):
    return blocks.parse_arg(arg, runlocal=False, kind="favor++", qk_norm="", redraw="", **SWEEP_ARGS,
                               **KIND_OPTIONS)


def get_config(arg=None):
    # one config is one run: the sweep's args (below) are ignored here
    args = _args(arg)
    c = blocks.run_config(total_steps=1500, batch_size=64, eval_batch_size=128, every=500, log_every=50)
    c.data = {"name": "digits", "test_fraction": 0.2, "split_seed": 0}
    c.task = {"name": "classification", "input": "image", "label_smoothing": 0.1}

    c.model = ml_collections.ConfigDict()
    c.model.name, c.model.preset = "vit", "tiny"
    c.model.image_size, c.model.patch_size, c.model.channels, c.model.num_classes = 8, 1, 1, 10
    c.model.hidden, c.model.num_layers, c.model.heads, c.model.mlp_dim = 64, 2, 4, 128
    # fixed 2-D sin-cos positions and mean pooling: with 1,437 images, learned position embeddings
    # and a class token overfit (92 % test accuracy, softmax or FAVOR++ alike; 97 % with these)
    c.model.pool, c.model.posemb = "mean", "sincos2d"
    c.model.dropout, c.model.attention_dropout = 0.1, 0.0
    c.model.dtype = "float32"
    c.model.init_from = ""             # uptraining: run:<workdir>, a checkpoint dir or hf:<dir>
    c.model.attention = blocks.attention(args.kind, num_features=64, redraw=args.redraw, qk_norm=args.qk_norm)
    for key in KIND_OPTIONS:
        if args[key]:
            c.model.attention[key] = args[key]

    c.optim = blocks.optim(lr=2e-3, schedule="cosine", warmup_steps=100, weight_decay=0.05, eps=1e-8)
    if args.runlocal:
        c.total_steps, c.batch_size, c.eval_batch_size = 64, 32, 128
        c.checkpoint_every, c.eval_every, c.log_every = 16, 32, 8
        c.model.hidden, c.model.num_layers, c.model.heads, c.model.mlp_dim = 32, 1, 2, 64
        c.model.attention.num_features = 16
        c.model.dropout, c.task.label_smoothing = 0.0, 0.0
        c.optim.warmup_steps, c.optim.lr = 4, 1e-2
    return c


def sweep(arg=None):
    """The kernel ablation: every attention kind (or `kinds`), each with `seeds` seeds (favor.tools.report
    averages them); `qk_norms=none/l2` and `redraws=step/fixed/every:100` add those axes."""
    args = _args(arg)
    if int(args.seeds) < 1:
        raise ValueError(f"seeds={args.seeds}: expected 1 or more")
    # each kind as its spec (favor#:saderf sets FAVOR#'s variant; favor.attention.parse_spec)
    from favor import attention        # the kinds' registry: JAX, which writing a config never needs
    from favor import sweeps
    from favor.attention import qknorm, schedule
    kinds = sweeps.kind_settings("kinds", args.kinds or "/".join(attention.names()))
    axes = {}
    if args.qk_norms:
        norms = blocks.values("qk_norms", args.qk_norms, ("none",) + tuple(n for n in qknorm.NORMS if n))
        axes["model.attention.qk_norm"] = tuple("" if q == "none" else q for q in norms)
    if args.redraws:
        axes["model.attention.redraw"] = blocks.values("redraws", args.redraws)
        for spec in axes["model.attention.redraw"]:
            schedule.parse(spec)            # a bad one fails the sweep here, not each of its runs later
    axes["seed"] = tuple(range(int(args.seeds)))
    for kind in kinds:
        for rest in sweeps.product(axes):
            yield {**kind, **rest}
