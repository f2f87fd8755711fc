"""``moe-rl train --config FILE [key.sub=value ...]``: run RL training."""
from __future__ import annotations

import argparse
import sys
import shlex

from moe_rl.config import iter_keys, load_config
from moe_rl.config.checks import config_warnings
from moe_rl.errors import UserError
from moe_rl.data.prompt_rules import unknown_characters
from moe_rl.orchestration.run_inputs import load_run_inputs
from moe_rl.engines.factory import engine_kind
from moe_rl.orchestration.placement import make_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="YAML config file, or the name of a shipped one (tiny_cpu.yaml, ...)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint of the run (its "
                             "tracker file), same data order; a fresh start when there is none")
    parser.add_argument("--resume-from", metavar="DIR", default=None,
                        help="continue from this checkpoint directory (iter_NNNNNNN)")
    parser.add_argument("--overwrite", action="store_true",
                        help="logging.dir holds a run: move it aside to <dir>.old-N and start "
                             "a new one there (without this, a new run there is refused)")
    parser.add_argument("--allow-change", metavar="KEY", action="append", default=[],
                        help="with --resume: accept this key differing from the checkpoint's "
                             "config (repeatable; a key that shapes the run is refused "
                             "otherwise)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. algorithm.replay=off trainer.optim.lr=1e-6")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    inputs = load_run_inputs(cfg)
    unreadable = unknown_characters(inputs.tokenizer, inputs.prompt_sets())
    for warning in (unreadable, *config_warnings(cfg), *engine_kind(cfg).config_warnings()):
        if warning:
            print(warning, file=sys.stderr, flush=True)
    make_plan(cfg)   # the run must fit its cluster before anything starts
    from moe_rl.orchestration.loop import run_training
    if args.overwrite and (args.resume or args.resume_from):
        raise UserError("--overwrite: a new run; it cannot be combined with --resume")
    allowed = tuple(k.strip() for item in args.allow_change for k in item.split(",") if k.strip())
    known = {key for key, *_ in iter_keys()}
    for key in allowed:
        if key not in known:
            raise UserError(f"--allow-change {key}: not a config key (see moe-rl config --keys)")
    again = shlex.join(["moe-rl", "train", "--config", args.config, *args.overrides,
                        "--resume"])
    run_training(cfg, inputs, resume=args.resume, resume_from=args.resume_from,
                 overwrite=args.overwrite, allow_changes=allowed, resume_command=again)
    return 0
