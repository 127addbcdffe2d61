"""A causal decoder language model (favor.models.decoder) with any attention kind.

    python train.py --config configs/decoder_lm.py --workdir runs/lm                         # Wikipedia
    python train.py --config configs/decoder_lm.py:data=local --workdir runs/lm-local        # offline
    python train.py --config configs/decoder_lm.py:data=local,kind=favor++ ...               # ablation
    python -m favor.tools.generate --workdir runs/lm-local --prompt "Return the"             # sample it

data=tfds (default): the Llama layout at GPT-2 small's size (preset "small": 12 layers, 768 wide, 12
heads, SwiGLU, rotary positions) on TFDS `wikipedia/20230601.en` (prepared with
`--file_format=array_record`), 1024-token packed rows, batch 256, AdamW at 6e-4 with warmup 2k and
cosine decay over 100k steps (GPT-2/nanoGPT-style settings); M = 256 features for random-feature kinds.
The sentencepiece vocabulary (32k) is trained on first use on 200k sampled articles.

data=local: the standard library's docstrings (favor_docstrings, built on first use) with a 4000-piece
vocabulary, the "mini" preset (4 layers, 256 wide) at 128 tokens, 3000 steps; runlocal: a tiny model for a
few steps (the tests).

Causal data-dependent kinds (favor++, favor#, hrf with lambda_=cluster) fit their features to running
statistics each layer keeps (never to the sequence, which would read the future).

init=<dir>: start from a Hugging Face GPT-2 or Llama directory (config.json + safetensors, and its
tokenizer.json when there is one): the model takes the checkpoint's sizes and layout
(favor.models.hf.decoder_config), `model.init_from=hf:<dir>`, and the data its tokenizer.

text=<path>: train on your own text instead (favor.data.files): a .txt/.jsonl file, a directory of them or
a glob; documents are a .txt file's paragraphs or a JSONL line's "text"; the last 2 % evaluate. With
data=local the model takes the local sizes; with init=<dir> a Hugging Face model's, and its tokenizer.

context=<tokens>: long-context rows of that many tokens (positions to match), the batch cut to keep
2^18 tokens a step; sequence=<n>: split every row over n devices (mesh.sequence, context parallelism:
favor.attention.sequence), e.g. `context=65536,sequence=8` on one 8-accelerator host.

Args: data=tfds|local, runlocal, kind=<attention kind>, window=<band of exact softmax, 0 = none>, init=<dir>,
text=<path>, context=<tokens>, sequence=<devices>.
"""

from pathlib import Path

import ml_collections

from favor.config import blocks, presets


def get_config(arg=None):
    args = blocks.parse_arg(arg, data="tfds", kind="favor+", window=0, init="", text="", runlocal=False,
                                context=0, sequence=1)
    data = blocks.choice("data", args.data, ("tfds", "local"))

    c = blocks.run_config(total_steps=100_000, batch_size=256, eval_batch_size=64, every=5_000,
                             keep_checkpoints=3)
    c.data = {"name": "causal_text", "dataset": "wikipedia/20230601.en", "text_field": "text",
              "train_split": "train[:99%]", "eval_split": "train[99%:]", "data_dir": None, "tokenizer": "",
              "vocab_size": 32000, "tokenizer_sample": 200_000, "max_length": 1024, "max_documents": 0, "packing": "documents",
              "max_eval_rows": 1024}
    c.task = {"name": "causal_lm"}
    c.model = ml_collections.ConfigDict()
    c.model.name, c.model.preset = "decoder", "small"
    c.model.vocab_size, c.model.max_positions = 32000, 1024
    c.model.dtype = "float32"
    c.model.init_from = ""
    c.model.attention = blocks.attention(args.kind, num_features=256)
    if int(args.window) < 0:
        raise ValueError(f"window={args.window}: expected 0 (none) or a positive number of tokens")
    if int(args.window):
        c.model.attention.window = int(args.window)
    c.optim = blocks.optim(lr=6e-4, schedule="cosine", warmup_steps=2_000, weight_decay=0.1, b2=0.95)
    if data == "local":
        c.data.update(dataset="local", train_split="train", eval_split="validation", vocab_size=4000,
                      tokenizer_sample=10_000, max_length=128, max_eval_rows=256)
        c.model.preset, c.model.vocab_size, c.model.max_positions = "mini", 4000, 512
        c.model.attention.num_features = 64
        c.total_steps, c.batch_size, c.eval_batch_size = 3000, 32, 64
        c.checkpoint_every, c.eval_every, c.log_every = 500, 500, 50
        c.optim.update(lr=2e-3, warmup_steps=200)
    if args.runlocal:
        c.data.update(dataset="local", train_split="train", eval_split="validation", vocab_size=400,
                      tokenizer_sample=2000, max_length=32, max_documents=400, max_eval_rows=32)
        c.model.preset, c.model.vocab_size, c.model.max_positions = "tiny", 400, 128
        c.model.hidden, c.model.num_layers, c.model.heads, c.model.mlp_dim = 32, 1, 2, 64
        c.model.attention.num_features = 16
        c.total_steps, c.batch_size, c.eval_batch_size = 40, 16, 32
        c.checkpoint_every, c.eval_every, c.log_every = 20, 40, 5
        c.optim.update(lr=3e-3, warmup_steps=4)
    if args.text:
        # the user's own plain-text or JSONL files (favor.data.files): the last 2 % of documents evaluate
        c.data.update(dataset=f"files:{args.text}", train_split="train[:98%]", eval_split="train[98%:]")
    # the preset's sizes as keys of their own, so a command line can set them (--config.model.hidden=128)
    sizes = presets.sizes("decoder", c.model.preset)
    for key in ("hidden", "num_layers", "heads", "mlp_dim"):
        if key not in c.model:
            c.model[key] = sizes[key]
    if int(args.context):
        n = int(args.context)
        if n < 8:
            raise ValueError(f"context={args.context}: expected a row length of at least 8 tokens")
        c.data.max_length, c.model.max_positions = n, max(n, int(c.model.max_positions))
        c.batch_size = c.eval_batch_size = max(1, 2 ** 18 // n)
    if int(args.sequence) != 1:
        c.mesh.sequence, c.mesh.data = int(args.sequence), -1
    if args.init:
        from favor.models import hf          # reads a checkpoint's config.json (JAX only for such configs)
        c.model.update(hf.decoder_config(args.init))
        c.model.init_from = f"hf:{args.init}"
        if (Path(args.init) / "tokenizer.json").exists():
            c.data.tokenizer = f"hf:{args.init}"
        c.data.max_length = min(int(c.data.max_length), int(c.model.max_positions))
    return c
