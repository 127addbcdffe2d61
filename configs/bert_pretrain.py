"""BERT masked-language-model pretraining with any attention kind (CRT Table 4).

    python train.py --config configs/bert_pretrain.py --workdir runs/bert-pretrain            # Wikipedia
    python train.py --config configs/bert_pretrain.py:data=local --workdir runs/bert-local    # offline
    python train.py --config configs/bert_pretrain.py:kind=favor+ ...                          # ablation

data=tfds (default): CRT Table 4's base model (12 layers, 12 heads, 768 hidden, 512 tokens, M = 256
features, dropout and attention dropout 0.1), batch 256, Adam at lr 1e-4 for 1M steps on TFDS
`wikipedia/20230601.en` (prepared with `--file_format=array_record`); the paper also used Books, which
TFDS does not carry. Warmup 10k steps then linear decay and weight decay 0.01 as in the BERT paper.
The sentencepiece vocabulary (32k) is trained on first use on 200k sampled articles, unless
`--config.data.tokenizer=wordpiece:<vocab.txt>` (uptraining a Hugging Face BERT: also set
`--config.model.init_from=hf:<dir>` and the model's vocab_size to the checkpoint's).

data=local: the standard library's docstrings (favor_docstrings, built on first use), the "local" preset
(BERT-Tiny's 2 layers × 128, favor/config/presets.py) at 128 tokens; runlocal: a tiny model for a few
steps (the tests).

Args: data=tfds|local, runlocal, kind=<attention kind>.

`sweep()` yields each kind of `kinds` (kind specs, kind[:variant]) × `seeds` seeds: CRT Table 4's
pretraining comparison, or one source to uptrain from (`python -m favor.repro uptrain-kernels` pretrains
its softmax BERT as `configs/bert_pretrain.py:data=local,seeds=1,kinds=softmax`).
"""

import ml_collections

from favor.config import blocks

SWEEP_ARGS = dict(seeds=1, kinds="softmax/favor+/favor++/favor#")      # the sweep's axes (get_config ignores them)


def _args(arg):
    return blocks.parse_arg(arg, data="tfds", kind="favor++", runlocal=False, **SWEEP_ARGS)


def sweep(arg=None):
    args = _args(arg)
    if int(args.seeds) < 1:
        raise ValueError(f"seeds={args.seeds}: expected 1 or more")
    from favor import sweeps                   # the kinds' registry: JAX, which writing a config never needs
    yield from sweeps.seed_by_seed(sweeps.kind_settings("kinds", args.kinds), range(int(args.seeds)))


def get_config(arg=None):
    # one config is one run: the sweep's args are ignored here
    args = _args(arg)
    data = blocks.choice("data", args.data, ("tfds", "local"))

    c = blocks.run_config(total_steps=1_000_000, batch_size=256, eval_batch_size=256, every=10_000,
                             keep_checkpoints=3)
    c.data = {"name": "text", "dataset": "wikipedia/20230601.en", "text_field": "text",
              "train_split": "train[:99%]", "eval_split": "train[99%:]", "data_dir": None, "tokenizer": "",
              "vocab_size": 32000, "tokenizer_sample": 200_000, "max_length": 512, "mask_rate": 0.15,
              "max_documents": 0, "packing": "stream", "max_eval_rows": 2048}
    c.task = {"name": "mlm"}
    c.model = ml_collections.ConfigDict()
    c.model.name, c.model.preset, c.model.head = "bert", "base", "mlm"
    c.model.vocab_size, c.model.max_positions = 32000, 512
    c.model.dropout, c.model.attention_dropout = 0.1, 0.1
    c.model.dtype = "float32"
    c.model.init_from = ""
    c.model.attention = blocks.attention(args.kind, num_features=256)
    c.optim = blocks.optim(lr=1e-4, schedule="linear", warmup_steps=10_000, weight_decay=0.01, eps=1e-6)
    if data == "local":
        # 1,000 pieces, not 4,000: at 4,000 the 2 × 128 model was still at 12 % masked-token accuracy after
        # 500-750 steps (lr 1e-3 or 3e-3), on the plateau of predicting frequent pieces; at 1,000 it left it
        # (19 % at step 1,000 of 1,000, loss falling 0.25 per 250 steps)
        c.data.update(dataset="local", train_split="train", eval_split="validation", vocab_size=1000,
                      tokenizer_sample=10_000, max_length=128, max_eval_rows=512)
        c.model.preset, c.model.vocab_size, c.model.max_positions = "local", 1000, 128
        c.model.attention.num_features = 64
        c.total_steps, c.batch_size, c.eval_batch_size = 3000, 64, 128
        c.checkpoint_every, c.eval_every, c.log_every = 500, 500, 50
        c.optim.update(lr=3e-3, warmup_steps=300)
    if args.runlocal:
        c.data.update(dataset="local", train_split="train", eval_split="validation", vocab_size=400,
                      tokenizer_sample=2000, max_length=32, max_documents=400, max_eval_rows=32)
        c.model.preset, c.model.vocab_size, c.model.max_positions = "tiny", 400, 32
        c.model.hidden, c.model.num_layers, c.model.heads, c.model.mlp_dim = 32, 1, 2, 64
        c.model.dropout, c.model.attention_dropout = 0.0, 0.0
        c.model.attention.num_features = 16
        c.total_steps, c.batch_size, c.eval_batch_size = 40, 16, 32
        c.checkpoint_every, c.eval_every, c.log_every = 20, 40, 5
        c.optim.update(lr=3e-3, warmup_steps=4)
    return c
