"""BERT fine-tuning on a GLUE task, with any attention kind (uptraining a softmax BERT as FAVOR).

    python train.py --config configs/bert_glue.py:task=sst2 --workdir runs/glue-sst2 \\
        --config.model.init_from=hf:/ckpt/bert-base-uncased --config.model.attention.kind=favor++
    python train.py --config configs/bert_glue.py:task=docorder,local --workdir runs/docorder \\
        --config.model.init_from=run:runs/bert-local              # from configs/bert_pretrain.py:data=local

Model sizes are CRT Table 4's base model (12 layers, 12 heads, 768 hidden, M = 256 features, dropout
and attention dropout 0.1); fine-tuning follows the BERT paper (Adam, lr 2e-5, batch 32, 3 epochs,
10 % linear warmup then linear decay, sequences up to 128 tokens). Expected on GLUE dev with a
pretrained checkpoint: the BERT-base range (e.g. SST-2 ≈ 92-93 % for softmax; FAVOR kinds a few
points lower without MLM uptraining). Data: TFDS `glue/<task>` prepared in `data_dir`.

The tokenizer comes with the model: a favor run's recorded one (`init_from=run:<workdir>`), or a
Hugging Face directory's vocab.txt (`init_from=hf:<dir>`); `vocab=<vocab.txt>` (or
`--config.data.tokenizer=wordpiece:<vocab.txt>`) overrides it. The model's sizes must be the source's
(a mismatch is an error that names the source's sizes to set).

Args: task=<cola|sst2|mrpc|qqp|stsb|mnli|qnli|rte|wnli|docorder> (docorder: favor's local sentence-order
task on the docstrings, favor.data.docorder, built on first use), vocab=<vocab.txt>, runlocal (the tiny model of
configs/bert_pretrain.py:runlocal, so the one continues as the other), local (the model of
configs/bert_pretrain.py:data=local, with a learning rate for its size), steps=<K> (the budget instead of 3
epochs; evaluations at each fifth of it).

`sweep()` yields each kind of `kinds` (kind specs, kind[:variant]: favor#:saderf) × `seeds` seeds;
uptraining a softmax source as every kind (`python -m favor.repro uptrain-kernels` runs and rates it):

    python launch/sweep_local.py --workdir runs/uptrain-docorder \
        --config configs/bert_glue.py:task=docorder,local,steps=300,kinds=softmax/favor+/favor++ \
        -- --config.model.init_from=run:runs/bert-local
"""

import ml_collections

from favor.config import blocks
from favor.data.glue import FIELDS, NUM_LABELS

# the sweep's axes (get_config ignores them)
SWEEP_ARGS = dict(seeds=3, kinds="softmax/favor+/favor++/favor#:saderf/favor#:sderf/elu/relu")


def _args(arg):
    return blocks.parse_arg(arg, task="sst2", vocab="", runlocal=False, local=False, steps=0, **SWEEP_ARGS)

TRAIN_SIZES = {"cola": 8551, "sst2": 67349, "mrpc": 3668, "qqp": 363846, "stsb": 5749, "mnli": 392702,
               "qnli": 104743, "rte": 2490, "wnli": 635,
               "docorder": 8090}


def get_config(arg=None):
    # one config is one run: the sweep's args are ignored here
    args = _args(arg)
    if args.runlocal and args.local:
        raise ValueError("runlocal and local are two model sizes: give one")
    task = blocks.choice("task", args.task, tuple(FIELDS))
    c = blocks.run_config(total_steps=max(1, 3 * TRAIN_SIZES[task] // 32), batch_size=32, eval_batch_size=128,
                             every=2000)
    c.data = {"name": "glue", "task": task, "tokenizer": f"wordpiece:{args.vocab}" if args.vocab else "", "max_length": 128,
              "buckets": (32, 64, 128), "data_dir": None, "eval_split": "validation", "max_examples": 0}
    c.task = {"name": "glue", "task": task}
    c.model = ml_collections.ConfigDict()
    c.model.name, c.model.preset = "bert", "base"
    c.model.head = "regression" if task == "stsb" else "classification"
    c.model.num_labels = NUM_LABELS.get(task, 2)
    c.model.dropout, c.model.attention_dropout = 0.1, 0.1
    c.model.dtype = "float32"
    c.model.init_from = ""
    c.model.attention = blocks.attention("favor++", num_features=256)
    c.optim = blocks.optim(lr=2e-5, schedule="linear", warmup_steps=c.total_steps // 10, weight_decay=0.01,
                              eps=1e-6)
    if args.local:
        # the local pretraining's model (its sizes must be the source's); a model this small fine-tunes at
        # a higher rate than BERT-base's 2e-5: from a softmax source at 19 % masked-token accuracy, 500 steps
        # of docorder reached 63.5 % at 3e-4 against 57.3 % at 1e-4 (one run each)
        c.model.preset, c.model.vocab_size, c.model.max_positions = "local", 1000, 128
        c.model.attention.num_features = 64
        c.optim.lr = 3e-4
    if args.runlocal:
        c.model.preset = "tiny"
        c.model.vocab_size, c.model.hidden, c.model.num_layers, c.model.heads, c.model.mlp_dim = 400, 32, 1, 2, 64
        c.model.max_positions = 32
        c.model.attention.num_features = 16
        c.data.max_length, c.data.buckets = 32, (16, 32)
        c.total_steps, c.batch_size, c.eval_batch_size = 12, 8, 16
        c.checkpoint_every, c.eval_every, c.log_every = 6, 12, 3
        c.optim.lr, c.optim.warmup_steps = 1e-3, 2
    if args.steps:
        if args.steps < 0:
            raise ValueError(f"steps={args.steps}: expected a positive number of steps")
        c.total_steps = int(args.steps)
        c.optim.warmup_steps = max(1, c.total_steps // 10)
        # five evaluations, the last at the final step
        c.eval_every = c.checkpoint_every = -(-c.total_steps // 5)
    return c


def sweep(arg=None):
    """Every kind of `kinds` (kind specs) × `seeds` seeds, seed by seed (favor.sweeps.seed_by_seed)."""
    args = _args(arg)
    if int(args.seeds) < 1:
        raise ValueError(f"seeds={args.seeds}: expected 1 or more")
    from favor import sweeps                   # the kinds' registry: JAX, which writing a config never needs
    yield from sweeps.seed_by_seed(sweeps.kind_settings("kinds", args.kinds), range(int(args.seeds)))
