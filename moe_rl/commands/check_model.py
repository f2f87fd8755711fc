"""``moe-rl check-model PATH [--data FILE] [--engine URL ...] [--start-engine reference|sglang]``:
is this checkpoint aligned in moe_rl? transformers, moe_rl's megatron-core model (and engine
servers) on the same prompts: routing agreement per MoE layer and |delta log-prob|, then a
verdict line (exit 1: not aligned)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import typing

from moe_rl.config.schema import RolloutConfig
from moe_rl.errors import UserError
from moe_rl.families import family
from moe_rl.families.shape import MoEShape

ENGINES = typing.get_args(typing.get_type_hints(RolloutConfig)["engine"])   # rollout.engine's
# the verdict's thresholds: float32 on both sides; a 16-bit engine's rounding alone moves its
# log-probs by ~1e-3 to 1e-2 (the tiny model in bfloat16: 5.9e-3), so it is judged at 0.1
MIN_AGREEMENT = 0.99
MAX_ABS_DELTA = 1e-3
MAX_ABS_DELTA_16_BIT = 0.1


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
    parser.add_argument("--start-engine", choices=ENGINES, default=None,
                        help="also start an engine server of this kind serving PATH on "
                             "127.0.0.1, check it as --engine does, and stop it")
    parser.add_argument("--engine-dtype", default="float32",
                        choices=["float32", "bfloat16", "float16"],
                        help="the started engine's dtype (default float32; a 16-bit one is "
                             f"judged at --max-abs-delta {MAX_ABS_DELTA_16_BIT})")
    parser.add_argument("--sglang-device", choices=["cuda", "cpu"], default="cuda",
                        help="the started SGLang's device (cpu: an environment from `moe-rl "
                             "sglang-cpu-env`)")
    parser.add_argument("--sglang-python", default=None, metavar="PYTHON",
                        help="the started SGLang's interpreter (default: this one)")
    parser.add_argument("--sglang-arg", action="append", default=[], metavar="ARG",
                        help="one more argument of the started SGLang's command line, e.g. "
                             "--sglang-arg=--tp-size --sglang-arg=8; repeatable")
    parser.add_argument("--engine-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="the longest an engine's check may take (default 600; a silent "
                             "server is refused after it)")
    parser.add_argument("--min-agreement", type=float, default=MIN_AGREEMENT,
                        help=f"least routing agreement on every MoE layer (default "
                             f"{MIN_AGREEMENT})")
    parser.add_argument("--max-abs-delta", type=float, default=None,
                        help=f"largest |delta log-prob| against transformers (default "
                             f"{MAX_ABS_DELTA}; {MAX_ABS_DELTA_16_BIT} with a 16-bit "
                             f"--engine-dtype)")


@contextlib.contextmanager
def _reading(path: str):
    """A checkpoint folder that cannot be read (weights missing or damaged, a tokenizer file
    that is not JSON) is one line naming it (UserError), not a traceback."""
    from safetensors import SafetensorError
    try:
        yield
    except (OSError, ValueError, SafetensorError) as exc:
        if isinstance(exc, UserError):
            raise
        first = (str(exc).splitlines() or [""])[0][:200]
        raise UserError(f"PATH: {path}: cannot be read as a Hugging Face checkpoint "
                        f"({type(exc).__name__}: {first})") from None


def _read_config(path: str) -> dict:
    """config.json's fields (UserError naming the file when it is not a JSON object)."""
    try:
        with open(path, encoding="utf-8") as fh:
            hf = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UserError(f"PATH: {path}: not a readable JSON file ({str(exc)[:200]})") from None
    if not isinstance(hf, dict):
        raise UserError(f"PATH: {path}: expected a JSON object of the model's fields, got "
                        f"{type(hf).__name__}")
    return hf


def run(args: argparse.Namespace) -> int:
    from moe_rl.checks.model import (check_engine, check_trainer, format_report, prompt_ids,
                                    started_engine, transformers_reference, verdict)
    config = os.path.join(args.path, "config.json")
    if not os.path.isfile(config):
        raise UserError(f"PATH: expected a Hugging Face checkpoint directory with config.json, "
                        f"got {args.path}")
    hf = _read_config(config)
    try:
        family(hf.get("model_type"))
    except ValueError as exc:
        raise UserError(f"PATH: {exc}") from None
    if args.max_prompts < 1:
        raise UserError(f"--max-prompts: expected >= 1, got {args.max_prompts}")
    if not 0 < args.engine_timeout <= 1e6:
        raise UserError(f"--engine-timeout: expected seconds in (0, 1e6], got "
                        f"{args.engine_timeout}")
    try:
        shape = MoEShape.from_hf(hf)
    except ValueError as exc:   # a size beyond any model, named before anything is allocated
        raise UserError(f"PATH: {config}: {exc}") from None
    with _reading(args.path):
        prompts = prompt_ids(args.path, int(hf.get("max_position_embeddings") or 4096),
                             args.data, args.prompt_key, args.max_prompts)
        ref = transformers_reference(args.path, prompts, shape)
        reports = list(check_trainer(args.path, ref, shape))
    reports += [check_engine(url, ref, shape, args.path, args.engine_timeout)
                for url in args.engine]
    if args.start_engine:
        with started_engine(args.start_engine, args.path, dtype=args.engine_dtype,
                            device=args.sglang_device, python=args.sglang_python,
                            extra_args=tuple(args.sglang_arg)) as url:
            report = check_engine(url, ref, shape, args.path, args.engine_timeout)
        reports.append(dataclasses.replace(report, name=f"started {args.start_engine} engine"))
    for line in format_report(reports, sum(len(p) - 1 for p in prompts), len(prompts)):
        print(line)
    sixteen = args.start_engine is not None and args.engine_dtype != "float32"
    max_delta = args.max_abs_delta if args.max_abs_delta is not None else (
        MAX_ABS_DELTA_16_BIT if sixteen else MAX_ABS_DELTA)
    aligned, line = verdict(reports, args.min_agreement, max_delta)
    worst = max(r.max_abs_delta for r in reports)
    if sixteen:
        line += f" ({args.engine_dtype} engine)"
    if not aligned and max_delta < worst <= MAX_ABS_DELTA_16_BIT:
        line += (f"; an engine serving 16-bit weights (bfloat16, float16) is off by its "
                 f"rounding alone: --max-abs-delta {MAX_ABS_DELTA_16_BIT} fits it "
                 f"(--engine-dtype with --start-engine sets it)")
    print(line)
    return 0 if aligned else 1
