"""``moe-rl report RUN_DIR [RUN_DIR ...] [--out DIR] [--smooth W]``: plots and a markdown
summary."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (logging.dir)")
    parser.add_argument("--out", default=None,
                        help="output directory (default: RUN_DIR/report for one run, "
                             "FIRST_RUN/report-vs-OTHERS for several)")
    parser.add_argument("--smooth", type=float, default=0.0, metavar="W",
                        help="draw TensorBoard's exponential moving average with weight W in "
                             "[0, 1) over the raw curves (default 0: raw only)")


def run(args: argparse.Namespace) -> int:
    from moe_rl.outputs.report import make_report
    print(make_report(args.runs, args.out, args.smooth))
    return 0
