"""Data sources, one small interface for all of them (favor.data.source), keyed by the name a config
gives. A source yields host-local numpy batches:

    source.train_batches(batch_size, start_step, seed)  # infinite, deterministic in (seed, step):
                                                          # a resumed run continues where it stopped
    source.eval_batches(batch_size)                       # the whole eval split once; short last batch
                                                          # padded, with batch["valid"] marking real rows

`batch_size` is global; each process gets rows [i·B/P, (i+1)·B/P) of every global batch, so the
sharded loop assembles global arrays from the local slices (favor.sharding.global_batch).

    data.names()            # every dataset name
    data.get(config.data)   # the source the block names (its other keys are the source's options)
    data.check(config.data) # the same errors as get, building nothing
    data.needs_tokenizer(config.data)   # whether an empty `tokenizer` leaves the source without one

A block may mix a second source into its training batches: `mix_in` (that source's block) and `mix_rate`
(the share of each batch it fills; favor.data.mixture).
"""

from __future__ import annotations

from favor.registry import Registry

REGISTRY = Registry("dataset", {
    "digits": "favor.data.digits:Digits",              # scikit-learn's digits (ships with it)
    "glue": "favor.data.glue:Glue",                    # TFDS glue/<task>
    "text": "favor.data.text:MaskedText",              # MLM pretraining on a TFDS text builder
    "causal_text": "favor.data.text:CausalText",       # next-token prediction on the same packed text
    "imagenet": "favor.data.imagenet:ImageNet",        # TFDS imagenet2012 (manual download)
    "speech": "favor.data.speech:Speech",              # TFDS librispeech or the espeak corpus
    "listops": "favor.data.listops:Listops",           # ListOps by LRA's rules (favor_listops)
    "mqar": "favor.data.mqar:Mqar",                    # multi-query associative recall (Zoology's construction)
})

names = REGISTRY.names


def _split_mix(block):
    """(the main block, the mixed-in block or None, the rate), with the mix keys' errors."""
    block = dict(block)
    extra, raw = block.pop("mix_in", None), block.pop("mix_rate", None)
    rate = raw
    if extra is not None and hasattr(extra, "keys") and not dict(extra):
        extra = None                         # an empty block (a config's placeholder): nothing mixed in
    if extra is None:
        if rate:
            raise ValueError(f"data.mix_rate={rate}: needs data.mix_in (the block of the source to mix in)")
        return block, None, 0.0
    if isinstance(extra, str) or not hasattr(extra, "keys"):
        raise ValueError(f"data.mix_in={extra!r}: expected a data block ({{'name': <one of "
                         f"{', '.join(names())}>, ...options}})")
    extra = dict(extra)
    if "mix_in" in extra:
        raise ValueError("data.mix_in.mix_in: a mixed-in source cannot mix in another")
    try:
        rate = float(rate if rate is not None else "nan")
    except (TypeError, ValueError):
        rate = float("nan")
    if not 0.0 < rate < 1.0:
        raise ValueError(f"data.mix_rate={'missing' if raw is None else repr(raw)}: expected the share of each "
                         f"training batch the mixed-in source fills, in (0, 1)")
    return block, extra, rate


def get(block):
    """The source a data block names, with its mixed-in source when it has one."""
    main, extra, rate = _split_mix(block)
    if extra is None:
        return REGISTRY.from_block(main)
    from favor.data.mixture import Mixture
    try:
        mixed_in = REGISTRY.from_block(extra)
    except (ValueError, KeyError) as e:
        raise ValueError(f"data.mix_in: {e}") from None
    return Mixture(REGISTRY.from_block(main), mixed_in, rate, names=(main.get("name"), extra.get("name")))


def needs_tokenizer(block) -> bool:
    """Whether the source `block` names must be given its tokenizer (`tokenizer`): it trains none of its own
    (its class sets NEEDS_TOKENIZER). False for a name that is not registered (`check` names that)."""
    name = dict(block).get("name")
    return name in REGISTRY.entries and bool(getattr(REGISTRY.lookup(name), "NEEDS_TOKENIZER", False))


def check(block) -> None:
    """`get`'s errors, building nothing."""
    main, extra, _ = _split_mix(block)
    REGISTRY.check_block(main)
    packing = dict(main).get("packing")
    allowed = getattr(REGISTRY.lookup(dict(main)["name"]), "PACKING", None) if packing is not None else None
    if allowed and packing not in allowed:       # the text sources' `packing`, refused before anything is read
        from favor.config.checks import ConfigError
        raise ConfigError("data.packing", packing, f"must be one of {', '.join(map(repr, allowed))}")
    if extra is not None:
        try:
            REGISTRY.check_block(extra)
        except (ValueError, KeyError) as e:
            raise ValueError(f"data.mix_in: {e}") from None
