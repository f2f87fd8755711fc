"""``moe-rl convert``: Hugging Face <-> Megatron checkpoints (single process, CPU or one GPU).

  moe-rl convert --to megatron --hf DIR --out FILE.pt
  moe-rl convert --to hf --megatron FILE.pt --hf DIR --out DIR2
  moe-rl convert --to hf --checkpoint CKPT [--ema] [--hf DIR] --out DIR2

A Megatron file holds ``{"model": megatron state_dict, "hf_config": dict}``. ``--checkpoint``
takes a saved step of a run (``checkpoints/iter_0000100``) or a run's checkpoint folder (its
latest complete step), whatever parallel layout wrote it (the weights are resharded to one
process). ``--hf`` gives the architecture (config.json) and the tokenizer files copied to the
output; with ``--checkpoint`` it defaults to the model the run was trained from.
"""
from __future__ import annotations

import argparse
import os
import pickle

from moe_rl.errors import UserError, first_line
from moe_rl.orchestration.checkpoint import CheckpointError, read_json
from moe_rl.config import ConfigError, load_yaml
from moe_rl.orchestration import checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", choices=["megatron", "hf"], required=True,
                        help="the layout to write: megatron (a trainer file from --hf) or hf (a "
                             "HF model from --megatron or a run's --checkpoint)")
    parser.add_argument("--hf", help="HF model directory (source, or architecture)")
    parser.add_argument("--megatron", help="Megatron file to convert to HF (--to hf)")
    parser.add_argument("--checkpoint",
                        help="a run's saved step (iter_NNNNNNN) or checkpoint folder (--to hf)")
    parser.add_argument("--ema", action="store_true",
                        help="with --checkpoint: export the EMA of the weights saved beside them")
    parser.add_argument("--out", required=True, help="output file (megatron) or directory (hf)")


def _checkpoint_step(path: str) -> str:
    """The saved step ``path`` names (a run's checkpoint folder: its latest complete one)."""
    if not os.path.isfile(os.path.join(path, checkpoint.MANIFEST)):
        latest = checkpoint.latest(path)
        if latest is None:
            raise checkpoint.CheckpointError(f"--checkpoint {path}: no complete checkpoint "
                                             f"there (expected iter_NNNNNNN folders or one)")
        path = latest
    checkpoint.verify(path)
    return path


def _layout(step_dir: str) -> dict:
    layout = read_json(os.path.join(step_dir, "layout.json"))
    if not isinstance(layout, dict):
        raise CheckpointError(f"{step_dir}/layout.json: expected a JSON object")
    return layout


def _source_model(step_dir: str) -> str:
    """The HF model a run was trained from (``model.path`` of the checkpoint's config)."""
    import yaml
    path = os.path.join(step_dir, "config.yaml")
    try:
        with open(path, encoding="utf-8") as fh:
            return str(load_yaml(fh)["model"]["path"])
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError, KeyError,
            TypeError) as exc:
        raise CheckpointError(f"{path}: no model.path to read ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def _hf_dir(path: str, flag: str = "--hf") -> str:
    """``path`` if it is a HF model directory (UserError otherwise)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{flag} {path}: not a Hugging Face model directory (no config.json)")
    return path


def _read_megatron(path: str) -> dict:
    """The state dict of a Megatron file ``convert --to megatron`` wrote: tensors and plain
    containers only (a crafted file cannot run code); UserError for anything else."""
    import torch
    if not os.path.isfile(path):
        raise UserError(f"--megatron {path}: no such file")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, UnicodeDecodeError,
            OSError) as exc:
        raise UserError(f"--megatron {path}: not a Megatron file written by moe-rl convert, or "
                        f"it holds more than tensors ({type(exc).__name__}: "
                        f"{first_line(exc)})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise UserError(f"--megatron {path}: expected a dict with a 'model' state dict")
    return saved["model"]


def run(args: argparse.Namespace) -> int:
    sources = [f for f in ("megatron", "checkpoint") if getattr(args, f)]
    if args.to == "hf" and len(sources) != 1:
        raise UserError("--to hf: give one of --megatron FILE or --checkpoint DIR")
    if args.to == "megatron" and (sources or not args.hf):
        raise UserError("--to megatron: give --hf DIR (and neither --megatron nor --checkpoint)")
    if args.ema and not args.checkpoint:
        raise UserError("--ema: only with --checkpoint")
    step_dir = _checkpoint_step(args.checkpoint) if args.checkpoint else None
    if args.hf:
        hf = _hf_dir(args.hf)
    elif step_dir:
        hf = _hf_dir(_source_model(step_dir), f"model.path of {step_dir}:")
    else:
        raise UserError("--to hf --megatron: needs --hf DIR (the architecture)")
    if step_dir and args.ema and not _layout(step_dir).get("ema"):
        raise UserError(f"--ema: {step_dir} was saved without an EMA (trainer.ema.decay unset)")
    state = _read_megatron(args.megatron) if args.megatron else None
    # megatron-core only now: a refused input answers without its import (~9 s of CPU on 2 cores)
    import torch
    from torch.distributed.checkpoint.api import CheckpointException   # a BaseException
    from moe_rl.weights.hf import load_hf_into_megatron, megatron_to_hf, save_hf_checkpoint
    from moe_rl.trainer.model_builder import build_model, load_hf_config
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.sharded_state import load_sharded_weights
    init_distributed()
    init_model_parallel()
    model, spec = build_model(hf)
    if args.to == "megatron":
        load_hf_into_megatron(model, spec, hf)
        torch.save({"model": model.state_dict(), "hf_config": load_hf_config(hf)}, args.out)
    else:
        if step_dir:
            try:
                load_sharded_weights(os.path.join(step_dir, "trainer", "dist"), model,
                                     use_ema=args.ema)
            except (Exception, CheckpointException) as exc:   # names the file or the key
                        raise CheckpointError(f"cannot read the weights of {step_dir} into {hf}: "
                                      f"{type(exc).__name__}: {first_line(exc)}") from None
            print(f"read {step_dir}")
        else:
            try:
                model.load_state_dict(state)
            except (RuntimeError, KeyError, TypeError) as exc:
                raise UserError(f"--megatron {args.megatron}: does not fit the model of --hf "
                                f"{hf}: {first_line(exc)}") from None
        save_hf_checkpoint(megatron_to_hf(model, spec), spec, args.out, source_dir=hf)
    print(f"wrote {args.out}")
    return 0
