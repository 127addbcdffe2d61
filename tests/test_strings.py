"""The one reader of each string format users type (favor.strings), the kind-spec list on top of it, and the
places that used to split by hand now reading through them."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from favor import attention, strings
from favor import sweeps
from favor.bench import common
from favor.repro import trained

ROOT = Path(__file__).resolve().parents[1]


def test_lists_take_either_separator_once_each_in_order():
    assert strings.items("favor+/favor#") == strings.items("favor+,favor#") == ("favor+", "favor#")
    assert strings.items(" a , b/a,,/ c ") == ("a", "b", "c")
    assert strings.items("") == strings.items(None) == ()


def test_choices_name_the_bad_value_and_the_valid_ones():
    assert strings.choices("recipes", "full/lolcats", ("lolcats", "full")) == ("full", "lolcats")
    with pytest.raises(ValueError, match=r"^recipes: unknown 'lora'; valid: lolcats/full$"):
        strings.choices("recipes", "full/lora", ("lolcats", "full"))
    with pytest.raises(ValueError, match=r"^--sides: an empty list; valid: vit/bert$"):
        strings.choices("--sides", "/", ("vit", "bert"), nonempty=True)
    assert strings.choices("--sides", "", ("vit",)) == ()


@pytest.mark.parametrize("text", ["16/x", "0,4", "-3", "1.5"])
def test_positive_ints_refuse_anything_else(text):
    with pytest.raises(ValueError, match=r"widths .*expected positive integers"):
        strings.positive_ints("widths", text)


def test_positive_ints():
    assert strings.positive_ints("widths", "16/64,256") == [16, 64, 256]
    assert strings.positive_ints("bands", "", nonempty=False) == []
    with pytest.raises(ValueError, match="bands ''"):
        strings.positive_ints("bands", "")


def test_a_config_spec_keeps_colons_and_slashes_of_its_arg():
    spec = "/x/configs/mqar.py:others=favor#:saderf/favor+,seeds=3"
    assert strings.config_spec(spec) == ("/x/configs/mqar.py", "others=favor#:saderf/favor+,seeds=3")
    assert strings.config_spec("configs/default.py") == ("configs/default.py", "")
    # as the reports print it: from the checkout's root, the whole arg
    assert trained.checkout_spec(spec) == "configs/mqar.py:others=favor#:saderf/favor+,seeds=3"
    assert trained.checkout_spec("/x/configs/default.py") == "configs/default.py"


def test_kind_spec_lists_read_once_everywhere():
    got = attention.parse_specs("--kinds", "favor#:saderf@16, favor+/softmax")
    assert got == [("favor#:saderf@16", "favor#", {"variant": "saderf", "window": 16}),
                   ("favor+", "favor+", {}), ("softmax", "softmax", {})]
    for bad, match in (("favor+/nope", r"--kinds: unknown attention kind 'nope'"),
                       ("favor+:x", r"--kinds: 'favor\+' has no variant"), ("", r"--kinds: an empty list")):
        with pytest.raises(ValueError, match=match):
            attention.parse_specs("--kinds", bad)
    # the sweeps' settings and the benchmarks' flags are the same reading
    assert sweeps.kind_settings("kinds", "favor#:saderf@16") == [
        {"model.attention.kind": "favor#", "model.attention.variant": "saderf", "model.attention.window": 16}]
    parser = argparse.ArgumentParser(prog="bench")
    assert common.specs(parser, "--kinds", "favor+,favor#:saderf") == ["favor+", "favor#:saderf"]
    assert common.ints(parser, "--lengths", "256/1024") == [256, 1024]
    with pytest.raises(SystemExit):
        common.specs(parser, "--kinds", "favor+,nope")


def test_strings_imports_no_jax():
    code = "import sys; import favor.strings; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_generated_section_is_read_and_replaced_between_its_markers_only():
    text = "# t\n\nintro\n<!-- a:begin -->\nold a\n<!-- a:end -->\nkept\n<!-- b:begin -->\nold b\n<!-- b:end -->\n"
    assert strings.markers("a") == ("<!-- a:begin -->", "<!-- a:end -->")
    assert strings.between(text, "a") == "old a" and strings.between(text, "c") is None
    new = strings.replace_between(text, "a", "new a\nline 2")
    assert new == text.replace("old a", "new a\nline 2")                 # the rest, b included, untouched
    assert strings.between(new, "a") == "new a\nline 2" and strings.between(new, "b") == "old b"
    assert strings.replace_between(text, "c", "x") is None
    assert strings.replace_between("<!-- a:begin -->\nonly a begin\n", "a", "x") is None
