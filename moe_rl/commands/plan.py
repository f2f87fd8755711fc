"""``moe-rl plan --config FILE [overrides] [--nodes N] [--gpus-per-node G] [--json]``: every
process the run would start (role, node, GPUs; engines' command lines and environment) and the
weight-update group, without starting anything. ``moe-rl train`` places its processes by the same
plan."""
from __future__ import annotations

import argparse
import json

from moe_rl.config import load_config
from moe_rl.run_inputs import load_run_inputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes (default: cluster.num_nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (default: cluster.gpus_per_node)")
    parser.add_argument("--json", action="store_true",
                        help='print {"processes": [{"role", "node", "gpus", "argv", "env", ...}], '
                             '"weight_update_group": ...}')
    parser.add_argument("--no-inputs", action="store_true",
                        help="skip the checks of the model, tokenizer, data and reward function "
                             "(a model's config.json is still read when present)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. cluster.num_nodes=4 trainer.tensor_parallel=2 (flags and overrides in any order)")


def run(args: argparse.Namespace) -> int:
    from moe_rl.orchestration.placement import format_plan, make_plan
    overrides = list(args.overrides)
    if args.nodes is not None:
        overrides.append(f"cluster.num_nodes={args.nodes}")
    if args.gpus_per_node is not None:
        overrides.append(f"cluster.gpus_per_node={args.gpus_per_node}")
    cfg = load_config(args.config, overrides)
    if not args.no_inputs:
        load_run_inputs(cfg)
    plan = make_plan(cfg)
    print(json.dumps(plan.to_json(), indent=1) if args.json else format_plan(plan))
    return 0
