"""favor without TensorFlow: the default job, MQAR and every benchmark command run in processes where
TensorFlow and TensorFlow Datasets cannot be imported (as on an accelerator image that carries JAX
alone), and a pipeline that needs them fails in one line naming the extra that installs them."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Python imports sitecustomize from the path at start-up, in every process started with this PYTHONPATH
# (train.py runs that a benchmark starts too): every finder is wrapped so that it finds neither package,
# exactly what an interpreter without them installed sees (importlib.util.find_spec gives None, an import
# raises ModuleNotFoundError)
HIDE = '''
import sys
HIDDEN = ("tensorflow", "tensorflow_datasets")


class Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''

# every benchmark subcommand at its smallest, in one process (jax's import is much of each one's time);
# the training ones (steps, train, uptrain) on the default job's runlocal config
BENCHES = '''
import sys
from favor.bench import cli
out = sys.argv[1]
short = ["--config.total_steps=4", "--config.eval_every=4", "--config.checkpoint_every=4", "--config.log_every=2"]
cli.main(["attention", "--lengths", "32", "--kinds", "favor+", "--repeats", "1", "--out", out])
cli.main(["ratios", "--length", "32", "--rounds", "1", "--targets", "favor+/causal,favor+/bidir,9", "--out", out])
cli.main(["parts", "--length", "64", "--repeats", "1", "--out", out])
cli.main(["steps", "--config", "configs/default.py:runlocal", "--kinds", "favor+", "--rounds", "1", "--out", out])
cli.main(["generate", "--lengths", "8", "--kinds", "favor+", "--tokens", "2", "--rounds", "1", "--preset", "tiny",
          "--num_features", "16", "--out", out])
cli.main(["train", "--config", "configs/default.py:runlocal", "--metric", "accuracy", "--target", "0",
          "--higher_is_better", "--out", out, "--", *short])
cli.main(["uptrain", "--config", "configs/default.py:runlocal", "--kinds", "favor+", "--steps", "4",
          "--transfer_steps", "2", "--source_steps", "4", "--draws", "1", "--workdir", out + "/runs", "--out", out,
          "--", "--config.eval_every=4", "--config.checkpoint_every=4", "--config.log_every=2"])
cli.main(["peers", "--lengths", "32", "--rounds", "1", "--modes", "bidirectional", "--out", out])
cli.main(["accel", "--kinds", "favor+", "--lengths", "32", "--modes", "causal", "--passes", "fwd", "--dtypes", "float32",
          "--head-dims", "64", "--tokens", "32", "--rounds", "1", "--out", out])
cli.main(["lora", "--presets", "tiny", "--ranks", "2", "--out", out])
cli.main(["tune", "--quick", "--modes", "causal", "--precisions", "bf16", "--out", out])
cli.main(["context", "--lengths", "64", "--devices", "1", "--time-devices", "1", "--out", out])
cli.main(["headline", "--out", out])
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("tensorflow", "tensorflow_datasets"))
assert not loaded, loaded[:5]
print("BENCHES DONE")
'''


def _env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE)
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path}


def _run(args, env, ok=True):
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_default_job_mqar_and_every_benchmark_run_without_tensorflow(tmp_path):
    env = _env(tmp_path)
    hidden = _run(["-c", "import tensorflow"], env, ok=False)
    assert hidden.returncode != 0 and "No module named 'tensorflow'" in hidden.stderr   # the hiding works
    short = ["--config.total_steps=4", "--config.eval_every=4", "--config.checkpoint_every=4", "--config.log_every=2"]
    done = _run(["train.py", "--config", "configs/mqar.py:runlocal", "--workdir", str(tmp_path / "mqar"), *short], env)
    assert "done: step 4" in done.stdout, done.stdout
    # the default job (a FAVOR++ ViT): `bench train` below starts train.py on it with the same flags, in this
    # environment, and passes its output through
    done = _run(["-c", BENCHES, str(tmp_path / "bench")], env)
    assert "BENCHES DONE" in done.stdout and "done: step 4, attention favor++" in done.stdout, done.stdout[-3000:]
    from favor.bench import cli
    assert set(cli.SUBCOMMANDS) == {"attention", "ratios", "parts", "steps", "generate", "train", "uptrain",
                                    "peers", "accel", "tune", "lora", "context", "headline"}   # a new subcommand is added to BENCHES above


def test_a_tfds_pipeline_without_tensorflow_is_one_line_naming_the_extra(tmp_path):
    env = _env(tmp_path)
    done = _run(["train.py", "--config", "configs/listops.py:runlocal", "--workdir", str(tmp_path / "run")], env,
                ok=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "pip install 'favor[tfds]'" in lines[-1], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
