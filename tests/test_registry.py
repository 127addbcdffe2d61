"""favor.registry.Registry: the one registry behind kernels, attention kinds, models, data, tasks and
reproductions."""

import sys

import pytest

from favor import attention, data, kernels, models, repro, tasks
from favor.registry import Registry


class Thing:
    OPTIONS = {"size": 1}

    def __init__(self, size):
        self.size = size


def test_a_registry_builds_by_name_and_names_what_is_valid():
    reg = Registry("widget", {"thing": Thing, "lazy": "json:JSONDecoder", "module": "json"})
    assert reg.names() == ("thing", "lazy", "module")
    assert reg.build("thing", size=3).size == 3 and reg.build("thing").size == 1
    assert reg.from_block({"name": "thing", "size": 5}).size == 5
    assert reg.lookup("lazy").__name__ == "JSONDecoder" and reg.lookup("module") is sys.modules["json"]
    with pytest.raises(ValueError, match=r"unknown widget 'nope'; valid: thing, lazy, module"):
        reg.lookup("nope")
    with pytest.raises(ValueError, match=r"widget 'thing' got unknown option\(s\) 'colour'; valid options: size=1"):
        reg.check_block({"name": "thing", "colour": "red"})


def test_every_package_registry_is_one():
    for registry in (kernels.registry.REGISTRY, attention.registry.REGISTRY, models.zoo.FAMILIES, data.REGISTRY,
                     tasks.REGISTRY, repro.REGISTRY):
        assert isinstance(registry, Registry) and registry.names()
    assert attention.names() == attention.registry.REGISTRY.names()
    assert models.names() == ("bert", "vit", "conformer", "decoder")


def test_an_attention_block_is_read_in_one_place():
    """read_block is the one reading of an attention block: a config's (loading.attention, every kind's
    options, those the kind does not take dropped, the redraw schedule checked) and a model's own (an option
    the kind does not take is an error); each error names the key at fault."""
    from favor import attention
    from favor.config import blocks
    block = blocks.attention("favor#", num_features=32, variant="saderf", qk_norm="l2")
    kind, options, qk = attention.read_block(block, from_config=True)
    assert kind == "favor#" and options["variant"] == "saderf" and options["num_features"] == 32
    assert "window_mix" not in options or options["window_mix"] == "shared"
    assert "lambda_" not in options and qk["qk_norm"] == "l2"
    assert attention.read_block("softmax", from_config=False) == ("softmax", {}, dict(blocks.QK_NORM_OPTIONS))
    for block, from_config, key in ((blocks.attention("nope", 8), True, "kind"),
                                    ({**blocks.attention("favor+", 8), "redraw": "sometimes"}, True, "redraw"),
                                    ({**blocks.attention("favor+", 8), "qk_norm": "l3"}, True, "qk_norm"),
                                    ({**blocks.attention("favor+", 8), "num_features": 0}, True, "num_features"),
                                    ({"kind": "favor+", "lambda_": "x"}, False, "lambda_"),
                                    ({"num_features": 8}, False, None)):
        with pytest.raises(attention.BlockError) as e:
            attention.read_block(block, from_config=from_config)
        assert e.value.key == key, (block, e.value)
