"""``moe-rl demo``: the CPU demo (what ``make demo`` runs): write the tiny model if absent, then
RL with R3 + GSPO + seq-MIS through the CPU reference engine serving FP8 numerics (a real
engine/trainer difference); each demo is a run of its own (a fresh run directory, printed);
prints the reward rise and what routing replay removed."""
from __future__ import annotations

import argparse
import os
import shlex

from moe_rl.config import load_config
from moe_rl.config.shipped import DEFAULT_CONFIG, config_path
from moe_rl.models.tiny import write_tiny_model
from moe_rl.orchestration.run_dir import fresh

# the demo's engine differs from the float32 trainer as production engines do: FP8 weights and
# activations (block-wise E4M3), bfloat16 elsewhere; the user's overrides come after these
DEMO_OVERRIDES = ["rollout.engine_dtype=bfloat16", "rollout.quantization=fp8"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"YAML config file or the name of a shipped one (default "
                             f"{DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. trainer.steps=20 algorithm.replay=off "
                             "(flags and overrides in any order)")


def run(args: argparse.Namespace) -> int:
    config = config_path(args.config)
    cfg = load_config(config, [*DEMO_OVERRIDES, *args.overrides])
    from moe_rl.orchestration.loop import run_training
    from moe_rl.outputs.run_summary import replay_summary
    cfg.logging.dir = fresh(cfg.logging.dir)   # each demo is a run of its own
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        write_tiny_model(cfg.model.init, cfg.model.path)
        print(f"wrote the tiny model to {cfg.model.path}")
    again = shlex.join(["moe-rl", "train", "--config", config, *DEMO_OVERRIDES,
                        *args.overrides, f"logging.dir={cfg.logging.dir}", "--resume"])
    history = run_training(cfg, resume_command=again)
    print(replay_summary(history, cfg))
    return 0
