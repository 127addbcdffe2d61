"""What a model is trained to do: the loss on a batch and the eval metrics, keyed by config.task.

A task has
    OPTIONS: its config keys and defaults
    loss(model, batch, deterministic) -> (scalar loss, {name: scalar})      (train step, jitted)
    eval_outputs(model, batch) -> {name: array}    (eval step, jitted: sums, or per-example outputs)
    finalize([outputs of every eval batch]) -> {metric: value}               (host, after the split)
    bind(source)  (optional): called once with the data source (the CTC task takes its tokenizer)

    tasks.names()            # every task name
    tasks.get(config.task)   # the task the block names (its other keys are the task's options)
    tasks.check(config.task) # the same errors as get, building nothing
"""

from __future__ import annotations

from favor.registry import Registry

REGISTRY = Registry("task", {
    "classification": "favor.tasks.classification:Classification",
    "glue": "favor.tasks.glue:Glue",
    "mlm": "favor.tasks.mlm:MaskedLM",
    "causal_lm": "favor.tasks.mlm:CausalLM",
    "ctc": "favor.tasks.ctc:Ctc",
})

names, get, check = REGISTRY.names, REGISTRY.from_block, REGISTRY.check_block
