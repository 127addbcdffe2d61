"""favor's entry point: pretraining, fine-tuning and ablations are all

    python train.py --config configs/<file>.py[:args] --workdir DIR [--config.a.b=value ...]

Configs are locked: overriding a key the config does not have is an error naming it. Every value is
checked (favor.job.validate) before anything is built or compiled; a bad one ends the run with
one last line `error: config.<key>=<value>: <what is allowed>` and exit status 2. A --workdir is a new
directory or the directory of the run to resume (favor.train.rundir): one that holds a run of another
configuration, or a checkpoint of another model, is refused the same way, and left as it was.
"""

import logging
import re
import sys
from pathlib import Path

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from favor import extras, runtime, strings
from favor.config import loading

FLAGS = flags.DEFINE_string("workdir", None, "directory for checkpoints, TensorBoard logs and summary.json")
MULTIHOST = flags.DEFINE_bool("multihost", False, "call jax.distributed.initialize() first (TPU pods and SLURM "
                              "clusters are detected; elsewhere give the three flags below)")
COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (implies --multihost)")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the job")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index")
CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "a configs/*.py file[:args]",
                                         lock_config=True)


def fail(message: str):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_flags(argv):
    """absl's flag parsing, where a bad override or config arg ends in one line naming it (absl would
    print its usage text, ml_collections a traceback)."""
    try:
        return flags.FLAGS(argv)
    except flags.IllegalFlagValueError as e:      # a value that does not parse as the key's type
        fail(_bad_value(argv, str(e)))
    except (AttributeError, KeyError) as e:       # ml_collections: a key the locked config does not have
        fail(_unknown_key(argv) or str(e))
    except (flags.Error, OSError, extras.MissingExtra) as e:   # MissingExtra: a config importing its pipeline
        fail(str(e))


def _config_spec(argv) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return CONFIG.default if isinstance(CONFIG.default, str) else "configs/default.py"


def _overrides(argv) -> dict:
    """{key: value as typed} of every --config.<key> on the command line (the last one wins, as absl)."""
    out = {}
    for i, arg in enumerate(argv):
        m = re.match(r"^--?(?:no)?config\.([^=]+)(?:=(.*))?$", arg, re.S)
        if m:
            value = m.group(2)
            if value is None and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                value = argv[i + 1]
            out[m.group(1)] = value
    return out


def _bad_value(argv, message: str) -> str:
    m = re.match(r"^flag --config(?:\.([\w.]+))?=", message)
    if m is None:
        return message
    if m.group(1) is None:
        # the config file's own error: ml_collections puts get_config's traceback in the message, whose
        # last line is the error itself
        last = [line for line in message.splitlines() if line.strip()][-1].strip()
        return f"--config {_config_spec(argv)}: {re.sub(r'^[A-Za-z]*Error: ', '', last)}"
    key = m.group(1)
    value = _overrides(argv).get(key)
    try:
        current = loading.get(CONFIG.value, key)
    except Exception:                             # the config did not load: absl's own message
        return message
    return f"config.{key}={value!r}: must be {loading.describe_type(current)} (the config has {current!r})"


def _unknown_key(argv) -> str | None:
    try:
        config = loading.load(_config_spec(argv))
    except Exception:
        return None
    for key in _overrides(argv):
        why = loading.missing_key(config, key)
        if why:
            return f"--config.{key}: {why}"
    return None


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.value:
        raise app.UsageError("--workdir is required (where checkpoints, logs and summary.json go)")
    spec = config_flags.get_config_filename(flags.FLAGS["config"])
    if not Path(strings.config_spec(spec)[0]).is_file():
        fail(f"--config {spec}: no such file")
    absl_logging.set_verbosity(absl_logging.WARNING)     # orbax logs every file it writes at INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    favor_log = logging.getLogger("favor")
    favor_log.addHandler(handler)
    favor_log.setLevel(logging.INFO)
    favor_log.propagate = False
    runtime.keep_host_pages()
    runtime.collect_less()
    if MULTIHOST.value or COORDINATOR.value:
        import jax
        # CPU processes talk through gloo (GPU and TPU backends use their own collectives)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # before any other jax call: every process then sees the global device list
        jax.distributed.initialize(coordinator_address=COORDINATOR.value, num_processes=NUM_PROCESSES.value,
                                   process_id=PROCESS_ID.value)
    config = CONFIG.value
    from favor import job                 # the training stack, loaded once the flags have parsed
    try:
        job.validate(config)        # job.run checks again; here the error is one line, not a traceback
    except (loading.UsageError, extras.MissingExtra) as e:
        fail(str(e))
    try:
        summary = job.run(config, FLAGS.value)
    except (extras.MissingExtra, loading.UsageError) as e:   # a pipeline whose optional packages are not
        fail(str(e))   # installed, a value only the built job can judge, a workdir or checkpoint of another run
    loss = "n/a (resumed at the end)" if summary["train_loss"] is None else f"{summary['train_loss']:.4f}"
    report = [f"done: step {summary['step']}, attention {summary['attention']}, train loss {loss}"]
    fixed = {"step", "train_loss", "steps_per_second", "attention", "checkpoint_dir", "tensorboard_dir", "preempted",
             "train_loss_history", "eval_history", "wall_seconds", "num_params", "trainable_params",
             "trainable_fraction"}
    for k, v in summary.items():
        if k not in fixed and isinstance(v, float):
            report.append(f"  eval {k}: {v:.4f}")
    if summary["trainable_params"] < summary["num_params"]:
        report.append(f"  trained {summary['trainable_params']:,} of {summary['num_params']:,} parameters "
                      f"({100 * summary['trainable_fraction']:.3g} %)")
    if summary["steps_per_second"]:
        report.append(f"  {summary['steps_per_second']:.1f} steps/s")
    report.append(f"  checkpoints: {summary['checkpoint_dir']}")
    report.append(f"  TensorBoard: tensorboard --logdir {summary['tensorboard_dir']}")
    print("\n".join(report), flush=True)


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=parse_flags)
