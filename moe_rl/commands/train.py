"""``moe-rl train --config FILE [key.sub=value ...]``: run RL training."""
from __future__ import annotations

import argparse
import sys

from moe_rl.commands import inputs_or_report, load_or_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint of the run (its "
                             "tracker file), same data order; a fresh start when there is none")
    parser.add_argument("--resume-from", metavar="DIR", default=None,
                        help="continue from this checkpoint directory (iter_NNNNNNN)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. algorithm.replay=off trainer.lr=1e-6")


def run(args: argparse.Namespace) -> int:
    cfg = load_or_report(args.config, args.overrides)
    if cfg is None:
        return 2
    inputs = inputs_or_report(cfg)
    if inputs is None:
        return 2
    from moe_rl.config import ConfigError
    from moe_rl.orchestration.placement import make_plan
    try:   # the run must fit its cluster before anything starts
        make_plan(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    from moe_rl.orchestration.checkpoint import CheckpointError
    from moe_rl.orchestration.loop import run_training
    try:
        run_training(cfg, inputs, resume=args.resume, resume_from=args.resume_from)
    except CheckpointError as exc:
        print(f"checkpoint error: {exc}", file=sys.stderr)
        return 2
    return 0
