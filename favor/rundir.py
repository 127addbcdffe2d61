"""A run directory (train.py's --workdir) belongs to the run that made it.

A run records the config that made it in `<workdir>/config.json` (the whole config, overrides applied;
favor.tools.report reads it too). A start in a directory that holds a run continues that run and no
other: every key except those a resume may change (`RESUMABLE`) must equal the recorded one, or the start
stops before anything is built, read or written, with one line naming the keys that differ. Without that
check a start with another attention kind read the old checkpoint as damaged and set it aside, and one
with parameters of the same shapes resumed them as the new kind, its keep rule deleting the old steps.

`record` writes the record, and is called once every check of a start has passed: a start that fails
leaves the directory byte for byte as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from favor.configcheck import UsageError
from favor.data import atomic

# What a resume may change: how long the run goes on, how often it evaluates, checkpoints and logs, how
# far ahead it reads, and where it runs (a checkpoint restores onto any mesh, the data may live elsewhere
# on another machine). Everything else changes what is trained. A key and every key under it.
RESUMABLE = ("total_steps", "eval_every", "checkpoint_every", "log_every", "keep_checkpoints", "prefetch",
             "eval_batch_size", "mesh", "sharding_rules", "data.data_dir")

# keys every favor run's config.json has; a config.json without them is some other program's file
RECORD_KEYS = ("model", "optim", "data", "total_steps")


class RunDirError(UsageError):
    """A --workdir that is not this run's to use: a file, another program's directory, another run."""


def flat(tree: dict, prefix: str = "") -> dict:
    """{"model.attention.kind": value, ...} of a nested dict (an empty dict is a value of its own)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _newest_checkpoint_config(workdir: Path) -> dict | None:
    """The config saved with the newest readable checkpoint (a run that wrote no config.json)."""
    checkpoints = workdir / "checkpoints"
    steps = sorted((int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()), reverse=True) \
        if checkpoints.is_dir() else []
    for step in steps:
        try:
            meta = json.loads((checkpoints / str(step) / "meta" / "metadata").read_text())
            return json.loads(meta["config"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def recorded_config(workdir: Path) -> dict | None:
    """The config of the run `workdir` holds (its config.json, else its newest checkpoint's), or None
    when it holds no run."""
    record = Path(workdir) / "config.json"
    if not record.exists():
        return _newest_checkpoint_config(Path(workdir))
    try:
        config = json.loads(record.read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict) or not all(k in config for k in RECORD_KEYS):
        raise RunDirError(f"--workdir {workdir}: its config.json is not a favor run's record (another program's "
                          f"directory, a Hugging Face model's say); give the run a directory of its own")
    return config


def resumable(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in RESUMABLE)


def differences(recorded: dict, config: dict) -> list[tuple[str, object, object]]:
    """(key, the run's value, this start's value) for every key both configs have that a resume may not
    change and that differs. Keys only one side has are left out: they are keys an older or newer favor
    has, not a difference of the runs. An empty `data.tokenizer` is the run's own recorded tokenizer."""
    have, want = flat(recorded), flat(config)
    out = []
    for key in sorted(set(have) & set(want)):
        if resumable(key) or (key == "data.tokenizer" and not want[key]):
            continue
        if have[key] != want[key]:
            out.append((key, have[key], want[key]))
    return out


def check(config, workdir) -> None:
    """That a start of `config` may use `workdir`: a new directory, an empty one, or one holding a run of
    the same config (resumed). Reads only; a RunDirError (one line) otherwise."""
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise RunDirError(f"--workdir {workdir} is a file; it must be a directory (a new one, or the directory of "
                          f"the run to resume)")
    recorded = recorded_config(workdir)
    if recorded is None:
        return
    differ = differences(recorded, json.loads(config.to_json()))
    if not differ:
        return
    shown = "; ".join(f"{k}={new!r} here, {old!r} in the run" for k, old, new in differ[:3])
    more = f" (and {', '.join(k for k, _, _ in differ[3:])})" if len(differ) > 3 else ""
    raise RunDirError(f"--workdir {workdir} holds a run of another configuration: {shown}{more}. A resume may "
                      f"change only {', '.join(RESUMABLE)}; to keep that run, train in another --workdir (starting "
                      f"from that run's weights there: --config.model.init_from=run:{workdir})")


def record(config, workdir) -> None:
    """Make `workdir` and write the run's config.json: what a later start is checked against (a resume
    rewrites it with its own cadence and length). Call once every check of the start has passed."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        atomic.write_text(workdir / "config.json", config.to_json(indent=1))
