"""The uptraining keys of a run's config — `model.init_from` and the `uptrain` block — checked before a run
builds anything, with what depends on them elsewhere (a data source's tokenizer, which a source model may
bring), and what other modules ask of them (`uses_lora`)."""

from __future__ import annotations

from favor import attention as attention_lib
from favor import data
from favor.config.checks import ConfigError, get, integer, number, regex
from favor.data.tokenizers import FORMS as TOKENIZER_FORMS
from favor.uptrain.init_from import parse
from favor.uptrain.transfer import NAMED

FINETUNE = ("all", "lora")


def uses_lora(uptrain) -> bool:
    """Whether a run with `uptrain` (config.uptrain) carries LoRA adapters: trainable="lora" (both stages)
    or finetune="lora" (the training after the transfer stage)."""
    return uptrain.get("trainable") == "lora" or uptrain.get("finetune", "all") == "lora"


def check(config) -> None:
    """`model.init_from` names a source (or is empty), and the `uptrain` block's values fit the run: a transfer
    stage needs a teacher and fits in the run, LoRA needs weights to freeze, patterns compile. ConfigError
    naming the first bad key."""
    spec = str(config.model.get("init_from", "") or "")
    if spec:
        try:
            parse(spec)
        except ValueError as e:
            raise ConfigError("model.init_from", spec, f"must be '' (fresh weights) or name a source: {e}") from None
    else:
        check_tokenizer_given(config)
    if "uptrain" not in config:
        return
    integer(config, "uptrain.transfer_steps", 0)
    steps = config.uptrain.transfer_steps
    if steps and not spec:
        raise ConfigError("uptrain.transfer_steps", steps, "needs model.init_from (the transfer stage's teacher "
                                                           "is the model the run starts from); 0 without one")
    if steps > config.total_steps:
        raise ConfigError("uptrain.transfer_steps", steps, f"must be at most total_steps ({config.total_steps})")
    if steps and config.model.attention.kind == "softmax":
        raise ConfigError("uptrain.transfer_steps", steps, "a softmax model is its own teacher: 0 for attention "
                                                           "kind softmax")
    number(config, "uptrain.lr", lambda v: v > 0, "a positive number")
    pattern = regex(config, "uptrain.trainable", "must be 'query_key', 'all', 'feature_maps', 'lora' or a regular "
                                                 "expression over parameter paths")
    if steps and pattern == "feature_maps":
        check_feature_maps(config)
    finetune = get(config, "uptrain.finetune") if "finetune" in config.uptrain else "all"
    if finetune not in FINETUNE:
        raise ConfigError("uptrain.finetune", finetune, f"must be one of {', '.join(map(repr, FINETUNE))} (what the "
                                                        "training after the transfer stage trains)")
    if pattern != "lora" and finetune != "lora":
        return
    key, value = ("uptrain.trainable", pattern) if pattern == "lora" else ("uptrain.finetune", finetune)
    if not spec:
        raise ConfigError(key, value, "needs model.init_from: LoRA freezes the weights the run "
                                      "starts from, and a model from scratch has none worth keeping")
    integer(config, "uptrain.lora_rank", 1)
    number(config, "uptrain.lora_alpha", lambda v: v > 0, "a positive number")
    for key in ("uptrain.lora_targets", "uptrain.lora_also"):
        regex(config, key, "must be a regular expression over dotted paths")


def check_tokenizer_given(config) -> None:
    """A run from fresh weights whose data source trains no tokenizer of its own (GLUE: the ids must be those of
    the model's vocabulary) must name one in `data.tokenizer`. A run with `model.init_from` may leave it empty:
    the source brings its tokenizer (favor.uptrain.tokenizer_spec), so only a run with neither is refused."""
    block = config.get("data", {})
    if "tokenizer" not in block or block["tokenizer"] or not data.needs_tokenizer(block):
        return
    raise ConfigError("data.tokenizer", block["tokenizer"],
                      f"data.tokenizer is empty and {block['name']} trains no tokenizer of its own: give "
                      f"{TOKENIZER_FORMS}, or start from a model that brings one (model.init_from=run:<a favor run>: "
                      "the tokenizer it recorded; hf:<a directory with vocab.txt>)")


def check_feature_maps(config) -> None:
    """trainable="feature_maps" trains what the attention layers learn beside their projections: a learned kind's
    feature map and a window's learned mix (SelfAttention makes a parameter for each where its kind has
    `learned` and `mixes`). A block with neither would give a transfer stage with nothing to train."""
    try:
        kind, options, _ = attention_lib.read_block(config.model.attention, from_config=True)
    except attention_lib.BlockError:
        return                     # the block's own fault, which models.check reports
    attn = attention_lib.get(kind, **options)
    if getattr(attn, "learned", False) or getattr(attn, "mixes", False):
        return
    others = [*(repr(k) for k in NAMED if k != "feature_maps"), "'lora'"]
    raise ConfigError("uptrain.trainable", "feature_maps",
                      f"selects nothing for {kind}: it has no learned feature map (the learned kinds: "
                      f"{', '.join(attention_lib.learned_kinds())}) and no learned window mix (window > 0 with "
                      f"window_mix='learned'); for {kind} train {', '.join(others)} or a regular expression over "
                      "parameter paths")
