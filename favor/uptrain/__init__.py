"""Uptraining: a run that continues from another model's parameters (`config.model.init_from`).

init_from    where the parameters come from (a favor run or checkpoint, a Hugging Face directory) and
             how they are put in place
tokenizer    the tokenizer that travels with the model from run to run
transfer     attention transfer, the stage (favor.train.stage) that first trains the model around its
             random-feature attention to imitate the softmax attention it replaces
options      the run's uptraining keys (init_from, the uptrain block) checked, with the tokenizer a run
             without init_from must name, and uses_lora
"""

from favor.uptrain import transfer
from favor.uptrain.init_from import FORMS, Origin, load_params, match, open_checkpoint, parse
from favor.uptrain.options import FINETUNE, check, uses_lora
from favor.uptrain.tokenizer import TOKENIZER_DIR, record_tokenizer, recorded_tokenizer, tokenizer_spec
from favor.uptrain.transfer import trainable_mask

__all__ = ["FINETUNE", "FORMS", "Origin", "check", "uses_lora", "TOKENIZER_DIR", "load_params", "match", "open_checkpoint", "parse",
           "record_tokenizer", "recorded_tokenizer", "tokenizer_spec", "trainable_mask", "transfer"]
