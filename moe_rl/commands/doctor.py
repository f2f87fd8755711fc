"""``moe-rl doctor --config FILE [overrides] [--json]``: check this node before a run (the working
directory, torch and CUDA, the GPUs (without --config on a GPU node: a run on all of them), the
model's checkpoint, megatron-core, Transformer Engine, SGLang in its environment with the flags the
config needs, NCCL, free disk, a shared filesystem for multi-node runs, the engine ports) and
print what is wrong with its fix. Exit status 1 when a check fails."""
from __future__ import annotations

import argparse
import json

from moe_rl.config import load_config
from moe_rl.checks.node import run_checks

MARKS = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file of the run (default: built-in "
                                         "defaults, a CPU run)")
    parser.add_argument("--json", action="store_true",
                        help='print [{"check", "status", "detail", "fix"}, ...]')
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. cluster.gpus_per_node=8")


def node_gpus() -> int:
    """CUDA GPUs this node has (0 without a CUDA torch)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    gpus = node_gpus()
    if args.config is None and gpus and not any(o.startswith("cluster.gpus_per_node=")
                                                for o in overrides):
        # the defaults are a CPU run: on a GPU node, check it as one using its GPUs
        overrides.append(f"cluster.gpus_per_node={gpus}")
        if not args.json:
            print(f"no --config: checking this node as a run on its {gpus} GPUs (give --config "
                  f"YOUR_CONFIG to check your run)")
    cfg = load_config(args.config, overrides)
    named = args.config is not None or any(o.startswith("model.path=") for o in overrides)
    findings = run_checks(cfg, model_named=named)
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
