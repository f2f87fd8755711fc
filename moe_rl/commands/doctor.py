"""``moe-rl doctor --config FILE [overrides] [--json]``: check this node before a run (torch and
CUDA, the GPUs, megatron-core, Transformer Engine, SGLang in its environment with the flags the
config needs, NCCL, free disk, a shared filesystem for multi-node runs, the engine ports) and
print what is wrong with its fix. Exit status 1 when a check fails."""
from __future__ import annotations

import argparse
import json

from moe_rl.config import load_config

MARKS = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file of the run (default: built-in "
                                         "defaults, a CPU run)")
    parser.add_argument("--json", action="store_true",
                        help='print [{"check", "status", "detail", "fix"}, ...]')
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. cluster.gpus_per_node=8")


def run(args: argparse.Namespace) -> int:
    from moe_rl.checks.node import run_checks
    cfg = load_config(args.config, list(args.overrides))
    findings = run_checks(cfg)
    if args.json:
        print(json.dumps([f.to_json() for f in findings], indent=1))
    else:
        width = max(len(f.check) for f in findings)
        for f in findings:
            print(f"[{MARKS[f.status]}] {f.check:<{width}}  {f.detail}")
            if f.fix:
                print(f"       {'':<{width}}  fix: {f.fix}")
        failed = [f.check for f in findings if f.status == "fail"]
        print(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed
              else "every check passed" + (" (with warnings)" if any(
                  f.status == "warn" for f in findings) else ""))
    return 1 if any(f.status == "fail" for f in findings) else 0
