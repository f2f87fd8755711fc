"""``moe-rl check-model PATH [--data FILE] [--engine URL ...]``: is this checkpoint aligned in
moe_rl? transformers, moe_rl's megatron-core model (and engine servers) on the same prompts:
routing agreement per MoE layer and |delta log-prob|, then a verdict line (exit 1: not aligned)."""
from __future__ import annotations

import argparse
import json
import os

from moe_rl.errors import UserError

# the verdict's thresholds (float32 on both sides; a 16-bit engine needs looser ones)
MIN_AGREEMENT = 0.99
MAX_ABS_DELTA = 1e-3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH",
                        help="the Hugging Face checkpoint (config.json, safetensors, tokenizer)")
    parser.add_argument("--data", default=None, metavar="FILE",
                        help="prompts from this JSONL or Parquet file (default: a few of its own)")
    parser.add_argument("--prompt-key", default="prompt", help="the prompt text's column")
    parser.add_argument("--max-prompts", type=int, default=16, help="at most this many prompts")
    parser.add_argument("--engine", action="append", default=[], metavar="URL",
                        help="also check the engine server at URL (SGLang or `moe-rl "
                             "serve-reference`, serving PATH, routing returned: SGLang's "
                             "--enable-return-routed-experts); repeatable")
    parser.add_argument("--min-agreement", type=float, default=MIN_AGREEMENT,
                        help=f"least routing agreement on every MoE layer (default "
                             f"{MIN_AGREEMENT})")
    parser.add_argument("--max-abs-delta", type=float, default=MAX_ABS_DELTA,
                        help=f"largest |delta log-prob| against transformers (default "
                             f"{MAX_ABS_DELTA}, float32; a 16-bit engine needs ~0.1)")


def run(args: argparse.Namespace) -> int:
    from moe_rl.families import family
    from moe_rl.checks.model import (check_engine, check_trainer, format_report, prompt_ids,
                                    transformers_reference, verdict)
    from moe_rl.families.shape import MoEShape
    config = os.path.join(args.path, "config.json")
    if not os.path.isfile(config):
        raise UserError(f"PATH: expected a Hugging Face checkpoint directory with config.json, "
                        f"got {args.path}")
    with open(config) as fh:
        hf = json.load(fh)
    try:
        family(hf.get("model_type"))
    except ValueError as exc:
        raise UserError(f"PATH: {exc}") from None
    if args.max_prompts < 1:
        raise UserError(f"--max-prompts: expected >= 1, got {args.max_prompts}")
    shape = MoEShape.from_hf(hf)
    prompts = prompt_ids(args.path, int(hf.get("max_position_embeddings") or 4096), args.data,
                         args.prompt_key, args.max_prompts)
    ref = transformers_reference(args.path, prompts, shape)
    reports = list(check_trainer(args.path, ref, shape))
    reports += [check_engine(url, ref, shape, args.path) for url in args.engine]
    for line in format_report(reports, sum(len(p) - 1 for p in prompts), len(prompts)):
        print(line)
    aligned, line = verdict(reports, args.min_agreement, args.max_abs_delta)
    print(line)
    return 0 if aligned else 1
