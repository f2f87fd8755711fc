"""``moe-rl demo``: the CPU demo (what ``make demo`` runs): write the tiny model if absent, then
RL with R3 + GSPO + seq-MIS through the CPU reference engine serving FP8 numerics (a real
engine/trainer difference); prints the reward rise and what routing replay removed."""
from __future__ import annotations

import argparse
import os
import time

from moe_rl.config import load_config

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_cpu.yaml")
# the demo's engine differs from the float32 trainer as production engines do: FP8 weights and
# activations (block-wise E4M3), bfloat16 elsewhere; the user's overrides come after these
DEMO_OVERRIDES = ["rollout.engine_dtype=bfloat16", "rollout.quantization=fp8"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=os.path.normpath(DEFAULT_CONFIG))
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, [*DEMO_OVERRIDES, *args.overrides])
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
    print(replay_summary(history, cfg))
    return 0


def replay_summary(history: list[dict], cfg) -> str:
    """What the engine/trainer difference was and what routing replay did about it, averaged
    over the run's steps."""
    def mean(key):
        vals = [h[key] for h in history if key in h]
        return sum(vals) / len(vals) if vals else float("nan")
    r = cfg.rollout
    engine = f"{r.quantization} " if r.quantization != "none" else ""
    lines = [f"engine: {engine}{r.engine_dtype} reference engine; trainer: {cfg.model.dtype}"]
    if cfg.algorithm.replay == "r3":
        lines.append(f"  without replay the trainer's own routers would have agreed with the "
                     f"engine on {100 * mean('routing/agreement'):.2f}% of (token, layer) "
                     f"choices; {100 * mean('routing/token_differs_frac'):.1f}% of tokens would "
                     f"have been routed differently in some layer")
        lines.append(f"  with R3 the trainer replays the engine's routing: mismatch/k3 "
                     f"{mean('mismatch/k3'):.2e}, extreme_frac {mean('mismatch/extreme_frac'):.4f}"
                     f" (what is left is the FP8 / bfloat16 arithmetic itself)")
    else:
        lines.append(f"  replay {cfg.algorithm.replay}: routing agreement "
                     f"{mean('routing/agreement'):.4f}, mismatch/k3 {mean('mismatch/k3'):.2e}")
    return "\n".join(lines)
