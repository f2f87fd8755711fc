"""``moe-rl train --config FILE [key.sub=value ...]``: run RL training."""
from __future__ import annotations

import argparse

from moe_rl.config import load_config
from moe_rl.run_inputs import load_run_inputs


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
    cfg = load_config(args.config, args.overrides)
    inputs = load_run_inputs(cfg)
    from moe_rl.orchestration.placement import make_plan
    make_plan(cfg)   # the run must fit its cluster before anything starts
    from moe_rl.orchestration.loop import run_training
    run_training(cfg, inputs, resume=args.resume, resume_from=args.resume_from)
    return 0
