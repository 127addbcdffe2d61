"""Every shipped config builds in each of its variants and passes validation; the arg string parses into
typed values; every attention kind a config can name is the kind it names (no coupling forced on it)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from favor import attention, job
from favor.config import loading
from favor.attention import qknorm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import bert_glue, bert_pretrain, conformer_librispeech, decoder_lm, default, mqar, vit_imagenet  # noqa: E402

RUN_KEYS = ("seed", "total_steps", "batch_size", "eval_batch_size", "checkpoint_every", "eval_every", "log_every",
            "keep_checkpoints", "mesh", "sharding_rules", "prefetch", "data", "task", "model", "optim")
CONFIG_FILES = sorted(p.name for p in (ROOT / "configs").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("module,arg", [
    (default, ""), (default, "runlocal"), (default, "kind=favor#,variant=saderf"),
    (bert_glue, "task=mrpc,vocab={tmp}/vocab.txt"), (bert_glue, "task=stsb,runlocal,vocab={tmp}/vocab.txt"),
    (bert_pretrain, ""), (bert_pretrain, "data=local"), (bert_pretrain, "runlocal"),
    (vit_imagenet, ""), (vit_imagenet, "variant=finetune,init={tmp}"), (vit_imagenet, "grid=16"),
    (vit_imagenet, "data=local"), (conformer_librispeech, ""), (conformer_librispeech, "data=local,kind=favor+"),
    (decoder_lm, ""), (decoder_lm, "data=local,kind=favor++"), (decoder_lm, "runlocal,window=8"),
    (mqar, ""), (mqar, "kind=favor#,num_features=32,window=4,pairs=16,seq_len=128"),
])
def test_every_config_variant_builds_and_validates(module, arg, tmp_path):
    c = module.get_config(arg.format(tmp=tmp_path))
    assert all(k in c for k in RUN_KEYS)
    assert c.batch_size % 2 == 0 and c.total_steps > 0 and c.model.attention.kind
    job.validate(c)


def test_arg_strings_parse_into_the_types_of_the_defaults():
    args = loading.parse_arg("runlocal,kind=favor#,steps=12,lr=0.5,flag=0,other=False",
                               runlocal=False, kind="favor++", steps=0, lr=1.0, flag=True, other=True, name="x")
    assert args.to_dict() == {"runlocal": True, "kind": "favor#", "steps": 12, "lr": 0.5, "flag": False,
                              "other": False, "name": "x"}
    assert isinstance(args.steps, int) and isinstance(args.lr, float)
    with pytest.raises(ValueError, match=r"unknown arg 'dat'; valid \(with defaults\): data='tfds', kind="):
        bert_pretrain.get_config("dat=local")
    with pytest.raises(ValueError, match="config arg grid='abc': expected an integer"):
        vit_imagenet.get_config("grid=abc")
    with pytest.raises(ValueError, match="config arg runlocal='maybe': expected True or False"):
        default.get_config("runlocal=maybe")
    with pytest.raises(ValueError, match="config arg 'kind' needs a value"):
        default.get_config("kind")
    with pytest.raises(ValueError, match="unknown data 'web'; valid: tfds, local"):
        conformer_librispeech.get_config("data=web")
    with pytest.raises(ValueError, match="unknown task 'sst'"):
        bert_glue.get_config("task=sst")
    assert default.get_config("runlocal=false").total_steps == default.get_config().total_steps
    assert default.get_config("runlocal=1").total_steps == default.get_config("runlocal").total_steps
    assert vit_imagenet.get_config("grid=16").model.patch_size == 14


def test_kind_options_in_the_arg_reach_the_attention_block():
    block = default.get_config("kind=hrf,lambda_=gaussian,importance_sampling=True").model.attention
    assert block.kind == "hrf" and block.lambda_ == "gaussian" and block.importance_sampling is True
    assert "antithetic" not in block                                 # unnamed: each kind keeps its default
    assert block.variant == "" and attention.block_options(block).get("variant") is None
    sharp = default.get_config("kind=favor#").model.attention        # an empty variant: FAVOR#'s own (SDERF)
    assert attention.get(**qknorm.split(attention.block_options(sharp))[0]).options["variant"] == "sderf"


def test_one_optimizer_block():
    o = loading.optim(lr=1, warmup_steps=10.0, b2=0.98)
    assert sorted(o) == sorted(loading.OPTIM_DEFAULTS) and len(o) == 12
    assert o.lr == 1.0 and isinstance(o.lr, float) and o.warmup_steps == 10 and isinstance(o.warmup_steps, int)
    assert o.b2 == 0.98 and o.name == "adamw" and o.accumulate_steps == 1
    with pytest.raises(ValueError, match="unknown key.s. beta1; valid: name, lr"):
        loading.optim(beta1=0.9)
    assert bert_pretrain.get_config().optim.to_dict() == dict(loading.OPTIM_DEFAULTS, lr=1e-4, schedule="linear",
                                                              warmup_steps=10_000, weight_decay=0.01, eps=1e-6)


EXPECTED_MECHANISM = {"favor": "trig", "favor+": "positive", "favor++": "oprf", "favor#": "sderf",
                      "hrf": "hrf-angular", "simrf": "positive"}


@pytest.mark.parametrize("config_file", CONFIG_FILES)
@pytest.mark.parametrize("kind", attention.names())
def test_each_kind_is_built_as_it_names_itself(config_file, kind):
    """Built exactly as the trainer builds it: no config may force a coupling on a kind (an orthogonal
    coupling turned simrf into FAVOR+), so each RF kind gets its own mechanism and coupling."""
    config = loading.load(str(ROOT / "configs" / config_file))
    config.model.attention.kind = kind
    options, qk = qknorm.split(attention.block_options(config.model.attention))   # the layer takes qk_*
    attn = attention.get(**options)
    assert attn.name == kind and qk["qk_norm"] == ""
    if isinstance(attn, attention.RandomFeatureAttention):
        assert attn.mech.name == EXPECTED_MECHANISM[kind]
        assert attn.coupling == ("simplex" if kind == "simrf" else "orthogonal")
        # and each kind's own redraw schedule (every random-feature kind: a fresh ω each step)
        assert str(attn.schedule) == attention.block_redraw(config.model.attention) == "step"


def test_a_coupling_the_user_asks_for_is_kept():
    config = default.get_config("kind=favor+")
    config.model.attention.coupling = "iid"              # --config.model.attention.coupling=iid
    assert attention.get(**qknorm.split(attention.block_options(config.model.attention))[0]).coupling == "iid"


def test_speech_data_and_the_conformer_agree_on_the_subsampling():
    """favor.data.speech states the Conformer's subsampling arithmetic itself (data does not import
    models); the model keeps its own. They must agree, or buckets and label widths are sized wrong."""
    from favor.data import speech
    from favor.models import conformer
    frames = np.arange(0, 3000)
    assert speech.MIN_FRAMES == conformer.MIN_FRAMES
    np.testing.assert_array_equal(speech.subsampled_length(frames), np.asarray(conformer.subsampled_length(frames)))
    assert int(speech.subsampled_length(speech.MIN_FRAMES)) == 1 and int(speech.subsampled_length(6)) == 0


def test_decoder_lm_sizes_are_keys_a_command_line_sets():
    """The decoder's sizes come from its preset but are config keys, so `--config.model.hidden=128`
    resizes the model (a flag on a key the config lacks is refused)."""
    c = decoder_lm.get_config("data=local")
    assert (c.model.hidden, c.model.num_layers, c.model.heads, c.model.mlp_dim) == (256, 4, 4, 704)
    for flag in ("model.hidden=128", "model.num_layers=2", "model.mlp_dim=384"):
        loading.apply_flag(c, flag)
    job.validate(c)
    assert (c.model.hidden, c.model.num_layers, c.model.mlp_dim) == (128, 2, 384)
