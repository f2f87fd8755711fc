"""Sub-commands of ``moe-rl``: each module has ``add_arguments(parser)`` and ``run(args)``."""
from __future__ import annotations

import sys

from moe_rl.config import Config, ConfigError, load_config


def load_or_report(path: str | None, overrides: list[str]) -> Config | None:
    """The validated config, or None after printing the error (the command then exits 2)."""
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return None


def inputs_or_report(cfg: Config):
    """The run's loaded inputs (:func:`moe_rl.run_inputs.load_run_inputs`), or None after
    printing the error."""
    from moe_rl.run_inputs import load_run_inputs
    try:
        return load_run_inputs(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return None
