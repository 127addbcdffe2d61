"""Writing a config imports no JAX and no TFDS: every configs/*.py's get_config() — and loading and
overriding one through favor.config.loading — in a process that then holds no jax, flax, TensorFlow or
TFDS; and the block defaults favor.config.blocks keeps agree with the modules that read them."""

import subprocess
import sys
from pathlib import Path

from favor import attention, sharding
from favor.config import blocks, loading
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
    heavy = [m for m in ("jax", "flax", "tensorflow", "tensorflow_datasets", "optax", "orbax") if m in sys.modules]
    assert not heavy, f"{path}: get_config() imported {heavy}"
    print(path.name)
from favor.config import loading                       # loading and overriding a config, as the tools do
config = loading.load("configs/default.py:runlocal")
loading.apply_flag(config, "model.attention.kind=favor+")
heavy = [m for m in ("jax", "flax", "tensorflow", "optax", "orbax") if m in sys.modules]
assert not heavy and config.model.attention.kind == "favor+", f"favor.config.loading imported {heavy}"
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout.split()) == len(list((ROOT / "configs").glob("*.py"))) >= 9


def test_block_defaults_agree_with_their_readers():
    from favor.attention import registry
    assert set(blocks.SPEC_OPTIONS) == set(registry.SPEC_OPTIONS)
    assert set(blocks.LEARNED_KINDS) == {k for k in attention.names() if getattr(attention.get(k), "learned", False)}
    assert qknorm.OPTIONS is blocks.QK_NORM_OPTIONS and lora.DEFAULT_TARGETS == blocks.LORA_TARGETS
    assert sharding.DEFAULT_RULES is blocks.DEFAULT_RULES
    # favor.config.loading (the checks) hands out the same writing helpers configs use
    assert loading.parse_arg is blocks.parse_arg and loading.attention is blocks.attention
