"""``moe-rl init-model``: write the tiny Qwen3-MoE model and its tokenizer in HF format."""
from __future__ import annotations

import argparse

from moe_rl.commands import load_or_report
from moe_rl.models.tiny import write_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config; its model.init shapes it")
    parser.add_argument("--out", help="output directory (default: model.path of the config)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")


def run(args: argparse.Namespace) -> int:
    cfg = load_or_report(args.config, args.overrides)
    if cfg is None:
        return 2
    out = write_tiny_model(cfg.model.init, args.out or cfg.model.path)
    print(f"wrote {out}")
    return 0
