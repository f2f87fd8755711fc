"""``moe-rl config``: print the resolved configuration (then check what ``train`` would read:
model, tokenizer, data, reward) or the documented table of keys."""
from __future__ import annotations

import argparse
import sys

from moe_rl.data.prompt_rules import unknown_characters
from moe_rl.orchestration.run_inputs import inputs_summary, load_run_inputs
from moe_rl.config import Config, ConfigError, dump_config, iter_keys, load_config
from moe_rl.config.checks import config_warnings
from moe_rl.engines.factory import engine_kind


def config_value(cfg: Config, key: str) -> str:
    """``key``'s resolved value as a config file would give it (``null`` for None)."""
    node = cfg
    for part in key.split("."):
        if not hasattr(node, part) or part.startswith("_"):
            raise ConfigError(f"--get: unknown key {key!r} (moe-rl config --keys lists them)")
        node = getattr(node, part)
    if hasattr(node, "__dataclass_fields__"):
        raise ConfigError(f"--get: {key!r} is a section; name one of its keys")
    return "null" if node is None else str(node).lower() if isinstance(node, bool) else str(node)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    parser.add_argument("--keys", action="store_true",
                        help="print every config key with its type, default and meaning (markdown)")
    parser.add_argument("--no-inputs", action="store_true",
                        help="skip the checks of the model, tokenizer, data and reward function "
                             "(for a config written away from the machine that runs it)")
    parser.add_argument("--get", metavar="KEY",
                        help="print only KEY's resolved value (for scripts; no input checks)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. trainer.optim.lr=1e-5 "
                             "(flags and overrides in any order)")


def run(args: argparse.Namespace) -> int:
    if args.keys:
        print("| key | type | default | meaning |\n|---|---|---|---|")
        for key, tp, default, doc in iter_keys():
            print(f"| `{key}` | {tp} | `{default!r}` | {doc} |")
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.get:
        print(config_value(cfg, args.get))
        return 0
    print(dump_config(cfg), end="", flush=True)
    for warning in (*config_warnings(cfg), *engine_kind(cfg).config_warnings()):   # as train
        print(warning, file=sys.stderr)
    if not args.no_inputs:   # on stderr: stdout stays the YAML alone
        inputs = load_run_inputs(cfg)
        warning = unknown_characters(inputs.tokenizer, inputs.prompt_sets())
        if warning:
            print(warning, file=sys.stderr)
        print(inputs_summary(cfg.data, cfg.model, inputs), file=sys.stderr)
    return 0
