"""``moe-rl demo``: the CPU demo (what ``make demo`` runs): write the tiny model if absent, then
RL with R3 + GSPO + seq-MIS through the CPU reference engine; prints the reward rise."""
from __future__ import annotations

import argparse
import os
import time

from moe_rl.commands import load_or_report

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_cpu.yaml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=os.path.normpath(DEFAULT_CONFIG))
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")


def run(args: argparse.Namespace) -> int:
    cfg = load_or_report(args.config, args.overrides)
    if cfg is None:
        return 2
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.orchestration.loop import run_training
    if not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        write_tiny_model(cfg.model.init, cfg.model.path)
        print(f"wrote the tiny model to {cfg.model.path}")
    start = time.perf_counter()
    history = run_training(cfg)
    minutes = (time.perf_counter() - start) / 60
    rewards = [h["reward/mean"] for h in history]
    k = min(10, len(rewards) // 2)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"demo: {len(rewards)} RL steps in {minutes:.1f} min; mean reward of the first {k} "
          f"steps {first:.3f}, of the last {k} steps {last:.3f} (rise {last - first:+.3f})")
    return 0
