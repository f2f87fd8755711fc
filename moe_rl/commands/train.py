"""``moe-rl train --config FILE [key.sub=value ...]``: run RL training."""
from __future__ import annotations

import argparse

from moe_rl.commands import inputs_or_report, load_or_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint of logging.dir, same data order")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. algorithm.replay=off trainer.lr=1e-6")


def run(args: argparse.Namespace) -> int:
    cfg = load_or_report(args.config, args.overrides)
    if cfg is None:
        return 2
    inputs = inputs_or_report(cfg)
    if inputs is None:
        return 2
    from moe_rl.orchestration.loop import run_training
    run_training(cfg, inputs, resume=args.resume)
    return 0
