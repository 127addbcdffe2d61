"""Two processes on this machine through jax.distributed (gloo CPU collectives, launched by
launch/multihost_local.sh) run the same job as one process: each feeds its half of every global batch,
checkpoints are written by both, and the results are the single-process ones."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from favor import job

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import default  # noqa: E402

OVERRIDES = ["--config.total_steps=4", "--config.eval_every=4", "--config.checkpoint_every=2",
             "--config.log_every=2"]


def test_two_processes_match_one(tmp_path):
    workdir = tmp_path / "two"
    out = subprocess.run(["bash", str(ROOT / "launch/multihost_local.sh"), "2", str(workdir),
                          "--config", "configs/default.py:runlocal", *OVERRIDES],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHON": sys.executable})
    logs = "".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("two.process*.log")))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs
    two = json.loads((workdir / "summary.json").read_text())

    config = default.get_config("runlocal")
    config.total_steps, config.eval_every, config.checkpoint_every, config.log_every = 4, 4, 2, 2
    one = job.run(config, tmp_path / "one")
    assert two["step"] == one["step"] == 4
    for k in ("train_loss", "loss", "accuracy"):
        assert two[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k


def test_hosts_with_different_widths_are_padded_to_the_widest(monkeypatch):
    """Speech buckets are chosen from each host's own rows: global_batch pads every host to the widest
    shape (zeros), learned through one all-gather of the shapes. Here process 0 of 2 sees a wider
    partner."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from favor import sharding
    local = {"features": np.ones((2, 5, 3), np.float32), "labels": np.ones((2, 4), np.int32),
             "valid": np.ones((2,), bool)}
    partner = np.asarray([9, 3, 6], np.int32)            # the other host: 9 frames, 3 features, 6 labels
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([np.asarray(x), partner]))
    out = sharding._pad_to_common_shape(local)
    assert out["features"].shape == (2, 9, 3) and out["labels"].shape == (2, 6) and out["valid"].shape == (2,)
    assert out["features"][:, 5:].sum() == 0 and out["features"][:, :5].sum() == 30
    assert out["labels"][:, 4:].sum() == 0


def test_imports_leave_the_backend_alone():
    """jax.distributed.initialize must run before any JAX computation: importing favor's modules and
    parsing every config (what train.py does before it) may not start a backend, not even for a constant."""
    code = ("import importlib, pkgutil, sys\n"
            "import jax._src.xla_bridge as xb\n"
            "import favor\n"
            "names = [m.name for m in pkgutil.walk_packages(favor.__path__, 'favor.')]\n"
            "names = [n for n in names if not n.endswith('__main__')]\n"
            "for n in names: importlib.import_module(n)\n"
            "sys.path.insert(0, '.')\n"
            "import configs.default as d\n"
            "d.get_config(''); d.get_config('runlocal')\n"
            "print(len(names), xb.backends_are_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    count, initialised = out.stdout.split()
    assert int(count) > 20 and initialised == "False", out.stdout


def test_processes_that_share_rows_need_no_share_of_the_batch(monkeypatch):
    """With 2 processes a batch must split between them only while the batch axes span them: mesh.data=1
    and a sequence axis over every device (both processes hold every row) takes a batch of 1; 8 data-
    parallel devices over 2 processes still need a batch they divide, named in one line."""
    import jax

    from configs import decoder_lm
    from favor import sharding
    from favor.config import checks
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    n = jax.device_count()
    c = decoder_lm.get_config("runlocal")
    c.data.max_length = 8 * n
    c.mesh = {"data": 1, "fsdp": 1, "sequence": n, "tensor": 1}
    c.batch_size = c.eval_batch_size = 1
    sharding.check(c)
    if n >= 2:
        c.mesh = {"data": n, "fsdp": 1, "sequence": 1, "tensor": 1}
        c.batch_size = c.eval_batch_size = n + 1
        with pytest.raises(checks.ConfigError, match=f"divisible by the number of data-parallel devices "
                                                          rf"\({n}\) and by the 2 processes"):
            sharding.check(c)
