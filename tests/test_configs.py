"""Every shipped config builds in each of its variants; the arg string parses strictly."""

import sys
from pathlib import Path

import pytest

from favor import configlib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import bert_glue, bert_pretrain, conformer_librispeech, default, vit_imagenet  # noqa: E402

RUN_KEYS = ("seed", "total_steps", "batch_size", "eval_batch_size", "checkpoint_every", "eval_every", "log_every",
            "keep_checkpoints", "mesh", "sharding_rules", "prefetch", "data", "task", "model", "optim")


@pytest.mark.parametrize("module,arg", [
    (default, ""), (default, "runlocal"), (default, "kind=favor#,variant=saderf"),
    (bert_glue, "task=mrpc"), (bert_glue, "task=stsb,runlocal"),
    (bert_pretrain, ""), (bert_pretrain, "data=local"), (bert_pretrain, "runlocal"),
    (vit_imagenet, ""), (vit_imagenet, "variant=finetune,init=/ckpt/vit"), (vit_imagenet, "grid=16"),
    (vit_imagenet, "data=local"), (conformer_librispeech, ""), (conformer_librispeech, "data=local,kind=favor+"),
])
def test_every_config_variant_builds(module, arg):
    c = module.get_config(arg)
    assert all(k in c for k in RUN_KEYS)
    assert c.batch_size % 2 == 0 and c.total_steps > 0 and c.model.attention.kind


def test_arg_strings_parse_strictly():
    assert configlib.parse_arg("runlocal,kind=favor#,x=false", ("runlocal", "kind", "x"), "w") == \
        {"runlocal": True, "kind": "favor#", "x": False}
    assert default.get_config("runlocal=false").total_steps == default.get_config().total_steps
    with pytest.raises(ValueError, match="configs/bert_pretrain.py: unknown arg.s. dat; valid: data, kind, runlocal"):
        bert_pretrain.get_config("dat=local")
    with pytest.raises(ValueError, match="unknown data 'web'; valid: tfds, local"):
        conformer_librispeech.get_config("data=web")
    with pytest.raises(ValueError, match="unknown task 'sst'"):
        bert_glue.get_config("task=sst")
