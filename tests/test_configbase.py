"""Writing a config imports no JAX: every configs/*.py's get_config() — and loading and overriding one
through favor.configlib — in a process that then holds no jax, flax or TensorFlow; and the block defaults configbase keeps agree with the modules that read them."""

import subprocess
import sys
from pathlib import Path

from favor import attention, configbase, configlib, sharding
from favor.attention import qknorm
from favor.models import lora

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_is_written_without_jax():
    code = """
import importlib.util, sys
sys.path.insert(0, ".")
from pathlib import Path
for path in sorted(Path("configs").glob("*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    str(config)                                   # printing it too
    heavy = [m for m in ("jax", "flax", "tensorflow", "optax", "orbax") if m in sys.modules]
    assert not heavy, f"{path}: get_config() imported {heavy}"
    print(path.name)
from favor import configlib                       # loading and overriding a config, as the tools do
config = configlib.load("configs/default.py:runlocal")
configlib.apply_flag(config, "model.attention.kind=favor+")
heavy = [m for m in ("jax", "flax", "tensorflow", "optax", "orbax") if m in sys.modules]
assert not heavy and config.model.attention.kind == "favor+", f"configlib imported {heavy}"
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout.split()) == len(list((ROOT / "configs").glob("*.py"))) >= 9


def test_block_defaults_agree_with_their_readers():
    from favor.attention import registry
    assert set(configbase.SPEC_OPTIONS) == set(registry.SPEC_OPTIONS)
    assert set(configbase.LEARNED_KINDS) == {k for k in attention.names() if getattr(attention.get(k), "learned", False)}
    assert qknorm.OPTIONS is configbase.QK_NORM_OPTIONS and lora.DEFAULT_TARGETS == configbase.LORA_TARGETS
    assert sharding.DEFAULT_RULES is configbase.DEFAULT_RULES
    # configlib (the checks) hands out the same writing helpers configs use
    assert configlib.parse_arg is configbase.parse_arg and configlib.attention is configbase.attention
