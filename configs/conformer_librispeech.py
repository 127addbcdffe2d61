"""Conformer-CTC speech recognition with FAVOR++ attention: LibriSpeech, or an offline espeak-ng corpus.

    python train.py --config configs/conformer_librispeech.py:data=tfds --workdir runs/librispeech
    python train.py --config configs/conformer_librispeech.py:data=local --workdir runs/speech-local
    python train.py --config configs/conformer_librispeech.py:data=hard --workdir runs/speech-hard

data=tfds: CRT Table 6 (Likhosherstov et al. 2022, the Conformer of §5.3.2): 17 layers, 4 heads, hidden
256 (the conformer preset "small"), batch 256, dropout 0.1, Adam at lr 1e-4, inputs of up to 512 encoder
frames (max_frames 2048 = 20.5 s -> 511 after 4× subsampling), M = 16 random features (Figure 3 has
M = 8 and 16). CRT trains a Conformer-Transducer; this is the same encoder with a CTC head (greedy
decoding, no language model), and the Conformer's swish where Table 6 says gelu. Not in Table 6 and
chosen here: 10k warmup steps (as the Conformer paper), 100k steps (≈ 90 epochs of the 960 h),
a 256-piece sentencepiece vocabulary trained on the transcripts, SpecAugment (favor.data.audio). Data:
TFDS `librispeech` prepared in data_dir (`tfds build librispeech --file_format=array_record`).
Not run here (LibriSpeech is not on this machine); CRT's Figure 3 reports FAVOR++ 2.5-3 WER points
better than FAVOR+ at M = 8 and 16.

data=local: favor's espeak-ng corpus (favor.data.espeak: digit strings and short commands, 4000
training clips from 10 voices, validation from 2 voices never heard in training; built in the cache on
first use in under a minute), a 4-layer, 96-wide Conformer (0.9 M parameters) with FAVOR++ attention
(M = 32), batch 16, 1200 steps, SpecAugment off (the clean synthetic corpus needs none to reach ~0 %).
Expected: validation WER below 50 % within 10 minutes on 2 CPU cores. Measured on 2 shared CPU cores
(seconds since training started: validation WER): 109 s: 78 %, 165 s: 7.7 %, 219 s: 2.2 %, 276 s: 0.6 %,
385 s: 0.0 % (1200 steps; 6 min 29 s for the whole command).

data=hard: the same model on favor_speech/hard: one or two phrases an utterance from a wider grammar
(76 words), 110-250 words a minute, speed perturbation 0.9-1.1, white noise at 5-20 dB SNR, the same
unseen validation voices; clips up to ~4.3 s (480 frames, in buckets of 240 and 480). A corpus for
telling attention kinds apart, where the local one saturates at 0 % WER.

Args: data=tfds|local|hard, kind=<attention kind> (default favor++), steps (the local corpora's budget,
default 1200), conv_kernel (the conv module's width in frames; 1: no mixing across frames there, so
that attention is the model's only context beyond the subsampling's 7 frames), runlocal (a tiny model
and a few steps on TFDS mock data, or with data=local|hard on the corpus's tiny config: the tests').

`sweep()` yields the speech kernel ablation (`python -m favor.repro speech-kernels` runs and rates it):
softmax; FAVOR+ and FAVOR++ at each of the `narrow` widths (CRT Fig. 3: M = 8, 16); FAVOR# at the
widest of them; FAVOR+, trig, HRF-angular and HRF-cluster at the `wide` width (HRF Table 2, at one
feature width for all; trig and HRF with qk_norm=l2); each with `seeds` seeds:

    python launch/sweep_local.py --workdir runs/sk \
        --config configs/conformer_librispeech.py:data=hard,steps=300,conv_kernel=1 -- \
        --config.model.hidden=64 --config.model.num_layers=3 "--config.data.buckets=(480,)"

(the flags after `--`: the smaller model the reproduction trains, to fit its hour on 2 cores;
`python -m favor.repro speech-kernels` runs this sweep in a workdir of its own and rates it)
"""

import ml_collections

from favor import strings
from favor.config import blocks

# the sweep's axes (get_config ignores them): "/"-separated narrow widths; floor=False leaves out the
# model without attention; quick: softmax and FAVOR+ at the narrowest width only (the tests')
SWEEP_ARGS = dict(seeds=3, narrow="8/16", wide=64, floor=True, quick=False)


def _args(arg):
    return blocks.parse_arg(arg, data="tfds", kind="favor++", steps=0, conv_kernel=0, runlocal=False,
                               **SWEEP_ARGS)


def get_config(arg=None):
    # one config is one run: the sweep's args are ignored here
    args = _args(arg)
    data = blocks.choice("data", args.data, ("tfds", "local", "hard"))

    c = blocks.run_config(total_steps=100_000, batch_size=256, eval_batch_size=64, every=5000)
    vocab = ml_collections.FieldReference(256)       # the tokenizer's size and the CTC head's, one value
    c.data = ml_collections.ConfigDict({
        "name": "speech", "dataset": "librispeech", "train_split": "train_clean100+train_clean360+train_other500",
        "eval_split": "dev_clean", "data_dir": None, "tokenizer": "", "max_frames": 2048,
        "buckets": (256, 512, 768, 1024, 1536, 2048), "spec_augment": True})
    c.data.vocab_size = vocab
    c.task = {"name": "ctc", "tokenizer": ""}

    c.model = ml_collections.ConfigDict()
    c.model.name, c.model.preset = "conformer", "small"          # CRT Table 6
    c.model.features = 80
    c.model.vocab_size = vocab
    c.model.dropout, c.model.attention_dropout = 0.1, 0.0
    c.model.self_attention = True      # False: no MHSA step (the floor of the sweep below)
    c.model.dtype = "float32"
    c.model.init_from = ""             # uptraining: run:<workdir>, a checkpoint dir or hf:<dir>
    # lambda_: HRF's λ estimator (angular | gaussian | cluster), here so that a sweep can set it; the
    # other kinds do not take it
    c.model.attention = blocks.attention(args.kind, num_features=16, lambda_="angular")
    c.optim = blocks.optim(lr=1e-4, schedule="constant", warmup_steps=10_000, weight_decay=0.0, b2=0.98, eps=1e-9)

    if data in ("local", "hard"):
        c.data.dataset, c.data.train_split, c.data.eval_split = "local", "train", "validation"
        c.data.max_frames, c.data.buckets = 300, (300,)      # the corpus's longest clip is ~2.8 s
        c.data.spec_augment = False
        vocab.set(64)
        c.total_steps, c.batch_size, c.eval_batch_size = 1200, 16, 100
        c.checkpoint_every, c.eval_every, c.log_every = 600, 200, 25
        c.model.preset = "mini"
        c.model.hidden, c.model.num_layers, c.model.heads, c.model.subsampling_channels = 96, 4, 4, 32
        c.model.conv_kernel = 15
        c.model.attention.num_features = 32
        c.optim.update(lr=2e-3, schedule="cosine", warmup_steps=100, weight_decay=0.01)
    if data == "hard":
        c.data.dataset = "local:hard"
        c.data.max_frames, c.data.buckets = 480, (240, 480)  # the longest of 120 clips: 4.3 s
        vocab.set(96)                                         # 76 words, not 40
    if int(args.steps) < 0 or int(args.conv_kernel) < 0:
        raise ValueError(f"steps={args.steps}, conv_kernel={args.conv_kernel}: expected positive values (0: the "
                         "config's own)")
    if int(args.steps) > 0:
        if data == "tfds" or args.runlocal:
            raise ValueError("steps= sets the local corpora's budget; not with data=tfds or runlocal (override "
                             "--config.total_steps there)")
        c.total_steps = int(args.steps)
        # three evaluations, the last at the final step (a third rounded down would evaluate twice there)
        c.checkpoint_every = c.eval_every = -(-int(args.steps) // 3)
    if args.runlocal:
        c.model.preset = "tiny"
        c.model.hidden, c.model.num_layers, c.model.heads, c.model.subsampling_channels = 32, 1, 2, 8
        c.model.conv_kernel = 3
        c.model.attention.num_features = 8
        vocab.set(32)
        if data == "tfds":
            c.data.max_frames, c.data.buckets = 128, (128,)
        else:   # the corpus's few-clip config, its clip lengths kept: a longer clip is dropped from training
            c.data.dataset = "local:hard_tiny" if data == "hard" else "local:tiny"
        c.total_steps, c.batch_size, c.eval_batch_size = 4, 8, 16
        c.checkpoint_every, c.eval_every, c.log_every = 4, 4, 2
        c.optim.update(lr=1e-3, warmup_steps=1)
    if int(args.conv_kernel) > 0:
        c.model.conv_kernel = int(args.conv_kernel)
    return c


def sweep(arg=None):
    """softmax; FAVOR+ and FAVOR++ at each `narrow` width and FAVOR# at the widest; FAVOR+, trig, HRF-angular
    and HRF-cluster at the `wide` width; then (`floor`) the model without self-attention; `seeds` seeds
    each. `quick`: softmax and FAVOR+ at the narrowest width alone."""
    args = _args(arg)
    if int(args.seeds) < 1:
        raise ValueError(f"seeds={args.seeds}: expected 1 or more")
    narrow = sorted(set(strings.positive_ints("narrow", args.narrow)))
    if not narrow or min(narrow) < 1 or int(args.wide) < 1:
        raise ValueError(f"narrow={args.narrow}, wide={args.wide}: expected positive widths, '/'-separated")
    kind, width, lam = "model.attention.kind", "model.attention.num_features", "model.attention.lambda_"
    settings = [{kind: "softmax"}]
    if args.quick:
        settings.append({kind: "favor+", width: narrow[0]})
    else:
        settings += [{kind: k, width: m} for m in narrow for k in ("favor+", "favor++")]
        settings.append({kind: "favor#", width: narrow[-1]})
        wide = int(args.wide)       # FAVOR+ at a narrow width already is FAVOR+ at that width
        # the sign-indefinite kinds (trig, HRF) with queries and keys on the sphere, as favor advises: without
        # it they barely train (README, "The kernel ablation"); HRF's theorems are stated on the sphere too
        sphere = {"model.attention.qk_norm": "l2"}
        settings += [{kind: "favor+", width: wide}] if wide not in narrow else []
        settings.append({kind: "favor", width: wide, **sphere})
        settings += [{kind: "hrf", lam: v, width: wide, **sphere} for v in ("angular", "cluster")]
        if args.floor:
            settings.append({"model.self_attention": False})
    from favor import sweeps
    yield from sweeps.seed_by_seed(settings, range(int(args.seeds)))
