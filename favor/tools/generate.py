"""Sample from a trained decoder: `python -m favor.tools.generate --workdir <run> --prompt "..."
[--max_tokens 64] [--temperature 0.8] [--top_k 40] [--seed 0] [--keep_going]`.

Loads the run's newest checkpoint (its parameters, its stored ω and the running statistics of
data-dependent kinds, with the evaluation ω for kinds that redraw, as the run's evaluation uses) and
its recorded tokenizer; runs the prompt through the causal pass (the prefill, which also leaves each
layer's cache) and then one token at a time. Linear kinds decode from a state whose size does not grow
with the sequence; softmax (and a window hybrid's band) keeps keys and values. `--temperature 0` is
greedy decoding; generation stops at the end of a document ([SEP]) unless --keep_going.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from favor import job, sharding, uptrain
from favor.train import checkpoint
from favor.data import tokenizers
from favor.models.decoder import Decoder
from favor.models.generation import decoding, sample  # noqa: F401  (sample: the tool's API too)


def generate(model: Decoder, prompt, max_tokens: int, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             stop_id: int | None = None, return_logits: bool = False):
    """prompt [B, P] token ids (P ≥ 1) -> [B, P + n] with n ≤ max_tokens new tokens (fewer when every row
    has produced `stop_id`); with `return_logits` also the logits each new token was drawn from, [B, n, V].
    Two compiled programs: the prefill and one decoding step."""
    prompt = np.asarray(prompt, np.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"generate: the prompt must be [batch, length ≥ 1] token ids; got shape {prompt.shape}")
    if temperature < 0 or top_k < 0 or max_tokens < 0:
        raise ValueError(f"generate: temperature, top_k and max_tokens must be ≥ 0; got {temperature}, {top_k}, "
                         f"{max_tokens}")
    if top_k > model.config["vocab_size"]:
        raise ValueError(f"generate: top_k {top_k} exceeds the vocabulary of {model.config['vocab_size']} tokens")
    p = prompt.shape[1]
    max_length = p + max_tokens
    if max_length > model.config["max_positions"]:
        raise ValueError(f"generate: {p} prompt tokens + {max_tokens} new ones exceed the model's max_positions "
                         f"{model.config['max_positions']}")
    prefill, step = decoding(model, max_length, temperature, top_k, seed)
    # tokens and logits stay on the device until the end: the host waits on a step only when it must
    # look at its token (to stop at `stop_id`)
    out, scores = [], []
    if max_tokens:
        token, logits, caches = prefill(jnp.asarray(prompt))
    done = np.zeros(prompt.shape[0], bool)
    for position in range(p, max_length):
        out.append(token)
        if return_logits:
            scores.append(logits)
        if stop_id is not None:
            done |= np.asarray(token) == stop_id
            if done.all():
                break
        if position + 1 < max_length:
            token, logits, caches = step(token, jnp.asarray(position, jnp.int32), caches)
    ids = np.concatenate([prompt, *(np.asarray(t)[:, None] for t in out)], axis=1)
    if not return_logits:
        return ids
    return ids, (np.stack([np.asarray(x) for x in scores], axis=1) if scores
                 else np.zeros((*prompt.shape[:1], 0, 0), np.float32))


def load(workdir):
    """(config, the decoder with the run's newest state and evaluation ω, its tokenizer) of a run."""
    workdir = Path(workdir).absolute()
    config = uptrain.open_checkpoint(uptrain.parse(f"run:{workdir}")).config
    if config.model.name != "decoder":
        raise ValueError(f"generate: {workdir} trained a {config.model.name!r} model; generation needs a decoder "
                         f"(configs/decoder_lm.py)")
    spec = uptrain.recorded_tokenizer(workdir)
    if spec is None:
        raise ValueError(f"generate: {workdir} recorded no tokenizer ({workdir / uptrain.TOKENIZER_DIR} is missing)")
    tokenizer = tokenizers.get(spec)
    model = job.make_model(config, None)
    layout = job.make_layout(model, sharding.make_mesh(config.mesh), config.sharding_rules, None)
    restored = checkpoint.Checkpointer(workdir / "checkpoints", asynchronous=False,
                                     read_only=True).restore_latest(layout.abstract)
    if restored is None:
        raise ValueError(f"generate: no readable checkpoint in {workdir / 'checkpoints'}")
    state = restored[0]
    params, rest = state["params"], state["rest"]
    features_fn = job.eval_features_fn(config, model)
    if features_fn is not None:
        rest = features_fn(params, rest)
    return config, nnx.merge(model.graphdef, params, rest), tokenizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m favor.tools.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="a decoder run (train.py --config configs/decoder_lm.py)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep_going", action="store_true", help="do not stop at the end of a document")
    parser.add_argument("--chat", action="store_true", help="the prompt as a user's turn of the tokenizer's chat "
                                                            "template (a Hugging Face instruct model's)")
    args = parser.parse_args(argv)
    try:
        config, model, tokenizer = load(args.workdir)
        if args.chat and not hasattr(tokenizer, "chat"):
            raise ValueError(f"generate: --chat needs a Hugging Face tokenizer with a chat template; the run's is "
                             f"{type(tokenizer).__name__}")
        prompt = tokenizer.chat(args.prompt) if args.chat else args.prompt
        ids = tokenizer.ids([prompt])[0]
        if not ids:
            raise ValueError(f"generate: the prompt {args.prompt!r} encodes to no tokens")
        out = generate(model, np.asarray([ids]), args.max_tokens, args.temperature, args.top_k, args.seed,
                       None if args.keep_going else tokenizer.sep_id)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    new = [int(t) for t in out[0, len(ids):] if int(t) != tokenizer.sep_id]
    print(tokenizer.decode(ids + new) if hasattr(tokenizer, "decode") else ids + new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
