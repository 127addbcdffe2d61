"""Loading config files as `--config` does, for the tools that need a config outside train.py's flags.

    python train.py --config configs/<file>.py:data=local,kind=favor#,runlocal ...

What configs are written with (parse_arg, run_config, optim, attention, apply_flag, ...) is
favor.config.blocks's and the checks' error and readers favor.config.checks's, neither importing JAX; both are
re-exported here for the tools that build or change configs. The check of a whole config before a run is
favor.job.validate, which composes each package's check of its own block.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from favor import strings

# the helpers configs are written and checked with, for the tools that build or change configs
from favor.config.blocks import (OPTIM_DEFAULTS, OPTIM_OPTIONAL, apply_flag, attention, choice,  # noqa: F401
                              missing_key, optim, parse_arg, run_config, values)
from favor.config.checks import ConfigError, UsageError, describe_type, get  # noqa: F401

__all__ = ["ConfigError", "UsageError", "OPTIM_DEFAULTS", "OPTIM_OPTIONAL", "apply_flag", "attention", "choice", "describe_type",
           "get", "load", "load_module", "missing_key", "optim", "parse_arg", "run_config", "values"]

# -- loading a config file -----------------------------------------------------------------------------
def load(spec: str):
    """The config of "path/to/file.py[:arg]", as `--config` loads it (not locked); for tools that need a
    config outside train.py's flags (the sweep launcher, train.py's error messages)."""
    path, arg = strings.config_spec(spec)
    module = load_module(path)
    return module.get_config(arg) if arg else module.get_config()


def load_module(path: str):
    module_spec = importlib.util.spec_from_file_location(f"favor_config_{Path(path).stem}", path)
    if module_spec is None or not Path(path).is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module
