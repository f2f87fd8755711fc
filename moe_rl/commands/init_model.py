"""``moe-rl init-model``: write a tiny Qwen3-MoE / DeepSeek-V3 / GLM-4.5 model and its
tokenizer in HF format, shaped by a config's ``model.init`` or by a named preset (warmed up,
cached)."""
from __future__ import annotations

import argparse

from moe_rl.config import load_config
from moe_rl.models.presets import PRESETS, write_preset
from moe_rl.models.tiny import write_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config; its model.init shapes the model")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a named shape instead of --config (medium: Qwen3-30B-A3B's MoE at "
                             "CPU scale, 8 layers, 64 experts, top-8, hidden 256), warmed up by "
                             "supervised steps on the arithmetic task and cached in its folder")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="with --preset: supervised warm-up steps (default: the preset's)")
    parser.add_argument("--out", help="output directory (default: model.path of the config, or "
                                      "the preset's folder under outputs/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. model.init.architecture=deepseek_v3 "
                             "model.init.seed=3 (flags and overrides in any order)")


def run(args: argparse.Namespace) -> int:
    if (args.config is None) == (args.preset is None):
        print("moe-rl init-model: give exactly one of --config FILE or --preset NAME")
        return 2
    if args.preset is not None:
        if args.warmup_steps is not None and args.warmup_steps < 0:
            print("--warmup-steps: expected >= 0")
            return 2
        out = write_preset(args.preset, args.out, args.warmup_steps)
    else:
        cfg = load_config(args.config, args.overrides)
        out = write_tiny_model(cfg.model.init, args.out or cfg.model.path)
    print(f"wrote {out}")
    return 0
