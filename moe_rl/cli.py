"""``moe-rl`` command line: one sub-command per module (in :mod:`moe_rl.commands`, and the
reference engine's server command beside its engine)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from moe_rl.errors import UserError
from moe_rl.orchestration.failures import RunFailed
from moe_rl.orchestration.stop import RunStopped

# sub-command -> (module under moe_rl.commands, or a full module path; one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "run RL training from a YAML config with key=value overrides"),
    "demo": ("demo", "build the tiny model and run the CPU demo (what `make demo` runs)"),
    "init-model": ("init_model", "write a tiny MoE model (Qwen3-MoE, DeepSeek-V3, GLM-4.5, "
                   "gpt-oss or MiniMax-M2 shape) and its tokenizer in HF format"),
    "serve-reference": ("moe_rl.engines.reference.command",
                        "serve a HF MoE model with SGLang's HTTP protocol on CPU"),
    "sglang-cpu-env": ("moe_rl.engines.sglang.cpu_environment",
                       "prepare an SGLang environment that serves on CPU (CPU torch, SGLang, "
                       "its import-time shims)"),
    "convert": ("convert", "convert checkpoints between Hugging Face and Megatron layouts"),
    "eval": ("eval", "evaluate a saved policy (checkpoint or HF model) on the eval.sets"),
    "report": ("report", "plot and summarise runs from their TensorBoard events"),
    "plan": ("plan", "print every process a run would start: node, GPUs, engine command lines"),
    "doctor": ("doctor", "check this node before a run: torch/CUDA, GPUs, megatron-core, TE, "
               "SGLang, NCCL, disk, shared filesystem, ports"),
    "check-model": ("check_model", "check that a HF checkpoint is aligned in moe_rl: "
                    "transformers, the trainer (and engines) on the same prompts, routing and "
                    "log-probs per layer"),
    "config": ("show_config", "print the resolved configuration, or the table of every key"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser with every available sub-command, and each sub-command's parser."""
    parser = argparse.ArgumentParser(
        prog="moe-rl", description="RL for Mixture-of-Experts LLMs: megatron-core trainer, "
        "SGLang or CPU reference engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands = {}
    for name, (module, help_text) in COMMANDS.items():   # each imports its work lazily
        mod = importlib.import_module(module if "." in module else f"moe_rl.commands.{module}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, command=name)
        commands[name] = p
    return parser, commands


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, flags and ``key=value`` overrides in any order (``train ... --resume
    trainer.steps=101``): a sub-command's arguments are parsed intermixed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, commands = build_parser()
    if argv and argv[0] in commands:
        return commands[argv[0]].parse_intermixed_args(argv[1:])
    return parser.parse_args(argv)   # help, or the error naming the commands


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``moe-rl`` console script."""
    if not sys.stderr.isatty():   # progress bars only on a terminal (logs keep no redraws)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UserError as exc:   # the user's input refused: one line, no traceback
        print(f"moe-rl {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except RunStopped as exc:   # a signal stopped the run cleanly: where it is, how to go on
        print(f"moe-rl {args.command}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except RunFailed as exc:   # a node or process of the run was lost: what, and how to go on
        print(f"moe-rl {args.command}: {exc}", file=sys.stderr, flush=True)
        return 1
    except BrokenPipeError:   # the reader of the output went away (`| head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
