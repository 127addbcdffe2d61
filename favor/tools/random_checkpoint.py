"""A Hugging Face decoder directory of random weights in the shape of a favor preset, for timing the
linearization recipe at a real model's size without downloading one:

    python -m favor.tools.random_checkpoint gpt2 --out /tmp/gpt2-small      # GPT-2 small's shape, 124M
    python -m favor.tools.random_checkpoint small --out /tmp/llama-small    # the Llama layout at that size

It writes config.json and model.safetensors (favor.models.hf.save_decoder), which favor.models.hf and
transformers both read; the weights are favor's initialisation, so its outputs mean nothing: only the
time and memory of what runs on it do. A directory that holds files already is refused (nothing is
overwritten).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    from favor.config import presets
    parser = argparse.ArgumentParser(prog="python -m favor.tools.random_checkpoint",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=list(presets.PRESETS["decoder"]), help="a decoder preset")
    parser.add_argument("--out", required=True, help="the directory to write (new or empty)")
    parser.add_argument("--vocab_size", type=int, default=None, help="default: the preset's (GPT-2's 50,257)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: --out {out} exists and is not an empty directory; nothing is overwritten", file=sys.stderr)
        return 2
    from flax import nnx
    from favor import models
    extra = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
    model = models.get("decoder", args.preset, rngs=nnx.Rngs(args.seed), **extra)
    models.hf.save_decoder(model, out)
    print(f"wrote {out} ({models.param_count(model):,} parameters, {args.preset} preset)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
