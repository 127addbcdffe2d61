"""A run directory (train.py's --workdir) belongs to the run that made it.

A run records the config that made it in `<workdir>/config.json` (the whole config, overrides applied;
favor.tools.report reads it too) and in every checkpoint's metadata. A start in a directory that holds
a run continues that run and no other: every key except those a resume may change (`RESUMABLE`) must
equal the record's (the newest checkpoint's, which is what a resume continues; config.json for a run
that saved none), or the start stops before anything is built, read or written, with one line naming
the keys that differ. Without that check a start with another attention kind read the old checkpoint as
damaged and set it aside, and one with parameters of the same shapes resumed them as the new kind, its
keep rule deleting the old steps.

`record` writes the record, and is called once every check of a start has passed: a start that fails
leaves the directory byte for byte as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax

from favor.config.checks import UsageError
from favor.data import atomic

# What a resume may change: how long the run goes on, how often it evaluates, checkpoints and logs, how
# far ahead it reads, where and how it runs (a checkpoint restores onto any mesh; the fused kernel and
# XLA compute the same attention; micro-batches sum to the same gradient; the data may live elsewhere on
# another machine). Everything else changes what is trained. A key and every key under it.
RESUMABLE = ("total_steps", "eval_every", "checkpoint_every", "log_every", "keep_checkpoints", "prefetch",
             "eval_batch_size", "mesh", "sharding_rules", "data.data_dir", "model.attention.impl",
             "optim.accumulate_steps")

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
    """The config saved with the newest checkpoint whose metadata reads, or None."""
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


def recorded_config(workdir: Path) -> tuple[dict | None, bool]:
    """(the config of the run `workdir` holds, whether it saved a checkpoint); (None, False) when it holds
    no run. The newest checkpoint's own config is the record where there is one: it is what a resume
    continues (a config.json can be older or newer than the weights); else the config.json of a run
    that stopped before its first checkpoint."""
    saved = _newest_checkpoint_config(Path(workdir))
    record = Path(workdir) / "config.json"
    if saved is not None or not record.exists():
        return saved, saved is not None
    try:
        config = json.loads(record.read_text())
    except (OSError, ValueError) as e:
        raise RunDirError(f"--workdir {workdir}: its config.json does not read ({type(e).__name__}: {e}) and it "
                          f"holds no checkpoint; give the run another directory") from None
    if not isinstance(config, dict) or not all(k in config for k in RECORD_KEYS):
        raise RunDirError(f"--workdir {workdir}: its config.json is not a favor run's record (another program's "
                          f"directory, a Hugging Face model's say); give the run a directory of its own")
    return config, False


def resumable(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in RESUMABLE)


def _resolved_model(model: dict) -> dict:
    """The model block as the model is built from it: every option with its value, the preset's and
    the attention kind's defaults filled in, options the kind does not take dropped. Two records then
    differ exactly where their models do, whichever favor wrote them and whichever optional keys
    (antithetic features, say) a config set. The block as it is when it does not resolve (a model or
    option this favor no longer has)."""
    from favor import attention as attention_lib, models      # the stack, only when there is a run to compare
    m = dict(model)
    name, preset, init_from = m.pop("name", None), m.pop("preset", "tiny"), m.pop("init_from", "")
    try:
        kind, options, qk = attention_lib.read_block(m.pop("attention", {"kind": "softmax"}), from_config=True)
        options = {**type(attention_lib.get(kind)).OPTIONS, **options}      # the kind's defaults filled in
        full = models.config(name, preset, **m, attention={"kind": kind, **options, **qk})
    except (ValueError, KeyError, TypeError):
        return model
    full = {k: (str(v) if k in ("dtype", "param_dtype") else v) for k, v in full.items()}
    return {"name": name, "preset": preset, "init_from": init_from, **json.loads(json.dumps(full))}


class _Missing:
    def __repr__(self):
        return "<missing>"


MISSING = _Missing()       # a key the run's record has and this start's config lacks


# keys added with a default that is not what a run recorded without them did: such a record reads as the
# old behaviour, so resuming it under the new default is a difference (not a newer favor's silent change)
BEFORE = {"data.packing": "stream"}     # text rows ran across documents before packing was an option


def differences(recorded: dict, config: dict) -> list[tuple[str, object, object]]:
    """(key, the run's value, this start's value) for every key a resume may not change whose value
    differs. The model block is compared as the model is built (`_resolved_model`). Elsewhere a key the
    run's record has and this start lacks differs (an optional setting dropped: `<missing>`); a key only
    this start has is a key of a newer favor (where it changes the train state, the checkpoint's tree
    then refuses the resume), but for the keys in BEFORE, read as their old behaviour. An empty
    `data.tokenizer` is the run's own recorded tokenizer."""
    resolve = lambda c: {**c, "model": _resolved_model(c["model"])} if isinstance(c.get("model"), dict) else c
    have, want = flat(resolve(recorded)), flat(resolve(config))
    have.update({k: v for k, v in BEFORE.items() if k not in have and k in want})
    out = []
    for key in sorted(have):
        if resumable(key) or (key == "data.tokenizer" and not want.get(key)):
            continue
        if have[key] != want.get(key, MISSING):
            out.append((key, have[key], want.get(key, MISSING)))
    kind = [d for d in out if d[0] == "model.attention.kind"]
    if kind:     # another kind: its own options are the consequence, named first, the other kind's left out
        out = kind + [d for d in out if d not in kind and not (d[0].startswith("model.attention.") and d[2] is MISSING)]
    return out


def _writable_parent(workdir: Path) -> None:
    """The directory the workdir is (or will be made in) must be one this process can write."""
    here = workdir
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        raise RunDirError(f"--workdir {workdir}: {here} is a file; the workdir must be a directory (a new one, or "
                          f"the directory of the run to resume)")
    if not os.access(here, os.W_OK | os.X_OK):
        raise RunDirError(f"--workdir {workdir}: {here} is not writable by this process")


def check(config, workdir) -> None:
    """That a start of `config` may use `workdir`: a new directory, an empty one, or one holding a run of
    the same config (resumed). Reads only; a RunDirError (one line) otherwise."""
    workdir = Path(workdir)
    _writable_parent(workdir)
    recorded, checkpointed = recorded_config(workdir)
    if recorded is None:
        return
    conf = json.loads(config.to_json())
    differ = differences(recorded, conf)
    if not differ:
        return
    shown = "; ".join(f"{k}={new!r} here, {old!r} in the run" for k, old, new in differ[:3])
    more = f" (and {', '.join(k for k, _, _ in differ[3:])})" if len(differ) > 3 else ""
    if not checkpointed:
        how = f"it saved no checkpoint: train in another --workdir, or remove {workdir} to use it for this one"
    elif recorded.get("model", {}).get("name") != conf.get("model", {}).get("name"):
        how = "to keep that run, train in another --workdir"
    else:
        how = (f"to keep that run, train in another --workdir (starting from that run's weights there: "
               f"--config.model.init_from=run:{workdir})")
    raise RunDirError(f"--workdir {workdir} holds a run of another configuration: {shown}{more}. A resume may "
                      f"change only {', '.join(RESUMABLE)}; {how}")


def record(config, workdir) -> None:
    """Make `workdir` and write the run's config.json: what a later start is checked against (a resume
    rewrites it with its own cadence and length). Call once every check of the start has passed."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        atomic.write_text(workdir / "config.json", config.to_json(indent=1))
