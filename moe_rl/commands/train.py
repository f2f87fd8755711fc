"""``moe-rl train --config FILE [key.sub=value ...]``: run RL training."""
from __future__ import annotations

import argparse

from moe_rl.config import ConfigError, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint of logging.dir, same data order")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. algorithm.replay=off trainer.lr=1e-6")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}")
        return 2
    from moe_rl.orchestration.loop import run_training
    run_training(cfg, resume=args.resume)
    return 0
