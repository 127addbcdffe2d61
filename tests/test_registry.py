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
