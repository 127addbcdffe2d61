"""BERT fine-tuning on a GLUE task, with any attention kind (uptraining a softmax BERT as FAVOR).

    python train.py --config configs/bert_glue.py:task=sst2 --workdir runs/glue-sst2 \\
        --config.model.init_from=hf:/ckpt/bert-base-uncased --config.model.attention.kind=favor++
    python train.py --config configs/bert_glue.py:task=sst2 --workdir runs/glue-sst2-local \\
        --config.model.init_from=run:runs/bert-local --config.model.preset=mini \\
        --config.model.vocab_size=4000 --config.model.max_positions=128     # from configs/bert_pretrain.py:data=local

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
configs/bert_pretrain.py:runlocal, so the one continues as the other).
"""

import ml_collections

from favor import configlib
from favor.data.glue import FIELDS, NUM_LABELS

TRAIN_SIZES = {"cola": 8551, "sst2": 67349, "mrpc": 3668, "qqp": 363846, "stsb": 5749, "mnli": 392702,
               "qnli": 104743, "rte": 2490, "wnli": 635,
               "docorder": 8090}


def get_config(arg=None):
    args = configlib.parse_arg(arg, task="sst2", vocab="", runlocal=False)
    task = configlib.choice("task", args.task, tuple(FIELDS))
    c = configlib.run_config(total_steps=max(1, 3 * TRAIN_SIZES[task] // 32), batch_size=32, eval_batch_size=128,
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
    c.model.attention = configlib.attention("favor++", num_features=256)
    c.optim = configlib.optim(lr=2e-5, schedule="linear", warmup_steps=c.total_steps // 10, weight_decay=0.01,
                              eps=1e-6)
    if args.runlocal:
        c.model.preset = "tiny"
        c.model.vocab_size, c.model.hidden, c.model.num_layers, c.model.heads, c.model.mlp_dim = 400, 32, 1, 2, 64
        c.model.max_positions = 32
        c.model.attention.num_features = 16
        c.data.max_length, c.data.buckets = 32, (16, 32)
        c.total_steps, c.batch_size, c.eval_batch_size = 12, 8, 16
        c.checkpoint_every, c.eval_every, c.log_every = 6, 12, 3
        c.optim.lr, c.optim.warmup_steps = 1e-3, 2
    return c
