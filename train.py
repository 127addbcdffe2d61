"""favor's entry point: pretraining, fine-tuning and ablations are all

    python train.py --config configs/<file>.py[:args] --workdir DIR [--config.a.b=value ...]

Configs are locked: overriding a key the config does not have is an error naming it.
"""

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from favor import runtime

FLAGS = flags.DEFINE_string("workdir", None, "directory for checkpoints, TensorBoard logs and summary.json")
MULTIHOST = flags.DEFINE_bool("multihost", False, "call jax.distributed.initialize() first (TPU pods and SLURM "
                              "clusters are detected; elsewhere give the three flags below)")
COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (implies --multihost)")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the job")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index")
CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "a configs/*.py file[:args]",
                                         lock_config=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.value:
        raise app.UsageError("--workdir is required (where checkpoints, logs and summary.json go)")
    absl_logging.set_verbosity(absl_logging.WARNING)     # orbax logs every file it writes at INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    favor_log = logging.getLogger("favor")
    favor_log.addHandler(handler)
    favor_log.setLevel(logging.INFO)
    favor_log.propagate = False
    runtime.keep_host_pages()
    if MULTIHOST.value or COORDINATOR.value:
        import jax
        # CPU processes talk through gloo (GPU and TPU backends use their own collectives)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # before any other jax call: every process then sees the global device list
        jax.distributed.initialize(coordinator_address=COORDINATOR.value, num_processes=NUM_PROCESSES.value,
                                   process_id=PROCESS_ID.value)
    from favor import trainer   # after flag parsing: a bad flag fails fast, before jax starts
    config = CONFIG.value
    summary = trainer.run(config, FLAGS.value)
    loss = "n/a (resumed at the end)" if summary["train_loss"] is None else f"{summary['train_loss']:.4f}"
    report = [f"done: step {summary['step']}, attention {summary['attention']}, train loss {loss}"]
    fixed = {"step", "train_loss", "steps_per_second", "attention", "checkpoint_dir", "tensorboard_dir", "preempted",
             "train_loss_history", "eval_history"}
    for k, v in summary.items():
        if k not in fixed and isinstance(v, float):
            report.append(f"  eval {k}: {v:.4f}")
    if summary["steps_per_second"]:
        report.append(f"  {summary['steps_per_second']:.1f} steps/s")
    report.append(f"  checkpoints: {summary['checkpoint_dir']}")
    report.append(f"  TensorBoard: tensorboard --logdir {summary['tensorboard_dir']}")
    print("\n".join(report), flush=True)


if __name__ == "__main__":
    app.run(main, argv=sys.argv)
