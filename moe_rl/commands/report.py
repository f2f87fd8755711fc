"""``moe-rl report RUN_DIR [RUN_DIR ...] [--out DIR]``: plots and a markdown summary."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (logging.dir)")
    parser.add_argument("--out", default="report", help="output directory (default: report)")


def run(args: argparse.Namespace) -> int:
    from moe_rl.report import make_report
    print(make_report(args.runs, args.out))
    return 0
