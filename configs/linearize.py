"""Linearizing a softmax decoder: the source and the sweep `python -m favor.repro linearize` runs.

    python train.py --config configs/linearize.py:stage=source --workdir runs/lin/source
    python launch/sweep_local.py --config configs/linearize.py:seeds=2 --workdir runs/lin/sweep \
        -- --config.model.init_from=run:runs/lin/source

The model: configs/decoder_lm.py:data=local (the standard library's docstrings, 128-token rows) at 2
layers × 128 wide, 4 heads of 32, a 2,000-piece vocabulary, batch 16. Every training batch, the
source's and each linearized run's, mixes in MQAR (favor.data.mqar: `pairs` key-value pairs at the row
length over the vocabulary's first 256 ids, zero filler unless `noise`) for `recall_rate` of its rows
(data.mix_in, favor.data.mixture), so that the source has a skill that needs its whole context, whose
loss under linear attention is measured (the docstrings alone are local: a 1,500-step source predicted
tokens seen earlier in its row beyond an 8-key band no better than the band alone, 33.3 % against
32.6 %, and recalled 0 % of MQAR zero shot); evaluation reads the docstrings alone. stage=source trains
it with softmax attention `source_steps` steps. stage=linearize (the default) continues a source given by
`--config.model.init_from` as `kind` (a band of `window` exact softmax keys when > 0) by a `recipe`:

- lolcats (LoLCATs, Zhang et al. 2024): attention transfer for `transfer_steps` steps training what the
  attention itself learns (a learned map's weights and the window's learned mix: trainable=feature_maps;
  a kind with neither, the random-feature kinds without a band, trains LoRA adapters there instead),
  then `steps` steps of the language-model loss training LoRA adapters (rank 8 on q, k, v, o) alone;
- full: `transfer_steps + steps` steps of the language-model loss training every parameter: the same
  number of steps and tokens.

Bands use LoLCATs' learned mix for the maps whose products are not estimates of exp(qᵀk/√D) (hedgehog,
t2r, ELU) and favor's shared normaliser for the random-feature kinds, whose products are.
kind=softmax with a window is the band alone (sliding-window softmax): no transfer stage (its attention
has nothing to learn), LoRA or full fine-tuning for the whole budget.

Args: stage=source|linearize, kind, window, recipe=lolcats|full, source_steps, transfer_steps, steps,
recall_rate (0: no MQAR), pairs, noise, runlocal (the tests' tiny model); the sweep's seeds, kinds ('/'-separated), band (the window of the
banded settings, 0: none), recipes and alone (whether the band alone is a setting).
"""

from configs import decoder_lm
from favor.config import blocks

KINDS = ("favor+", "favor++", "favor#", "hedgehog", "t2r", "elu")
RECIPES = ("lolcats", "full")
MIXED = ("hedgehog", "t2r", "elu")          # bands with LoLCATs' learned mix
SOURCE_LR = 2e-3
FULL_LR = SOURCE_LR / 4          # fine-tuning practice: a quarter of the source's peak rate
LORA_LR = SOURCE_LR              # adapters starting at zero take a larger rate than full fine-tuning
TRANSFER_LR = 1e-2               # LoLCATs' attention-transfer rate
RECALL_VOCAB = 256


def _args(arg):
    return blocks.parse_arg(arg, stage="linearize", kind="favor+", window=0, recipe="lolcats",
                               source_steps=3000, transfer_steps=50, steps=250, recall_rate=0.5, pairs=4, noise=False,
                               runlocal=False,
                               seeds=2, kinds="/".join(KINDS), band=8, recipes="/".join(RECIPES), alone=True)


def recipe_overrides(kind: str, window: int, recipe: str, transfer_steps: int, steps: int) -> dict:
    """The dotted config keys a setting's recipe sets (what the sweep passes as overrides): every key a
    recipe depends on, so that a run's flags alone fix it whatever get_config's own arg defaults to."""
    blocks.choice("recipe", recipe, RECIPES)
    total = transfer_steps + steps
    # no transfer stage: its keys at the config's defaults
    none = {"uptrain.transfer_steps": 0, "uptrain.trainable": "query_key", "uptrain.lr": 1e-3}
    if recipe == "full":
        return {**none, "uptrain.finetune": "all", "optim.lr": FULL_LR, "total_steps": total}
    if kind == "softmax":                   # the band alone: nothing for a transfer stage to train
        return {**none, "uptrain.finetune": "lora", "optim.lr": LORA_LR, "total_steps": total}
    own = kind in blocks.LEARNED_KINDS or (window and kind in MIXED)
    return {"uptrain.transfer_steps": transfer_steps, "uptrain.trainable": "feature_maps" if own else "lora",
            "uptrain.finetune": "lora", "uptrain.lr": TRANSFER_LR if own else 1e-3, "optim.lr": LORA_LR,
            "total_steps": total}


def sweep(arg=None):
    """stage=source: the one source run. Else every kind of `kinds` without and with the band, and (with
    `alone`) the band alone (softmax@band), by each recipe, seed by seed."""
    args = _args(arg)
    if args.stage == "source":
        yield {"seed": 0}
        return
    if int(args.seeds) < 1 or int(args.band) < 0:
        raise ValueError(f"seeds={args.seeds}, band={args.band}: expected seeds ≥ 1 and a band ≥ 0")
    from favor import attention        # the kinds' registry: JAX, which writing a config never needs
    from favor import sweeps
    kinds = blocks.values("kinds", args.kinds, [k for k in attention.names() if k != "softmax"])
    band = int(args.band)
    shapes = [(k, w) for k in kinds for w in ((0, band) if band else (0,))]
    shapes += [("softmax", band)] if band and args.alone else []
    settings = []
    for recipe in blocks.values("recipes", args.recipes, RECIPES):
        for kind, window in shapes:
            s = {"model.attention.kind": kind, "model.attention.window": window,
                 **recipe_overrides(kind, window, recipe, int(args.transfer_steps), int(args.steps))}
            if window and kind in MIXED:
                s["model.attention.window_mix"] = "learned"
            settings.append(s)
    yield from sweeps.seed_by_seed(settings, range(int(args.seeds)))


def get_config(arg=None):
    args = _args(arg)
    stage = blocks.choice("stage", args.stage, ("source", "linearize"))
    for name in ("source_steps", "steps"):
        if int(args[name]) < 1:
            raise ValueError(f"{name}={args[name]}: expected a positive integer")
    if int(args.transfer_steps) < 0 or int(args.window) < 0:
        raise ValueError(f"transfer_steps={args.transfer_steps}, window={args.window}: expected integers ≥ 0")
    c = decoder_lm.get_config("data=local,runlocal" if args.runlocal else "data=local")
    if not args.runlocal:
        c.model.update(hidden=128, num_layers=2, heads=4, mlp_dim=384, vocab_size=2000)
        c.data.vocab_size = 2000
        c.batch_size = 16
    rate = float(args.recall_rate)
    if not 0 <= rate < 1:
        raise ValueError(f"recall_rate={args.recall_rate}: expected the share of each batch in [0, 1)")
    if rate:
        # MQAR over the vocabulary's first 256 ids (its other ids are the docstrings' too): the task a
        # 2,000-id vocabulary would take far longer to learn (favor.repro.mqar_kernels' finding at 2,048)
        c.data.mix_in = {"name": "mqar", "vocab_size": RECALL_VOCAB, "seq_len": int(c.data.max_length),
                         "num_pairs": int(args.pairs), "random_non_queries": bool(args.noise)}
        c.data.mix_rate = rate
    c.model.attention = blocks.attention("softmax" if stage == "source" else args.kind,
                                            num_features=int(c.model.attention.num_features))
    if stage == "source":
        c.total_steps = int(args.source_steps)
        c.optim.lr = SOURCE_LR
        every = max(c.total_steps // 5, 1)
    else:
        c.model.attention.window = int(args.window)
        if int(args.window) and args.kind in MIXED:
            c.model.attention.window_mix = "learned"
        for key, value in recipe_overrides(args.kind, int(args.window), args.recipe, int(args.transfer_steps),
                                           int(args.steps)).items():
            blocks.apply_flag(c, f"{key}={value}")
        c.optim.warmup_steps = max(c.total_steps // 10, 1)
        every = max(c.total_steps // 5, 1)
    c.eval_every = c.checkpoint_every = every
    c.keep_checkpoints = 1
    return c
