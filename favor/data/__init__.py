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

names, get, check = REGISTRY.names, REGISTRY.from_block, REGISTRY.check_block
