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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", choices=["megatron", "hf"], required=True)
    parser.add_argument("--hf", help="HF model directory (source, or architecture)")
    parser.add_argument("--megatron", help="Megatron file to convert to HF (--to hf)")
    parser.add_argument("--checkpoint",
                        help="a run's saved step (iter_NNNNNNN) or checkpoint folder (--to hf)")
    parser.add_argument("--ema", action="store_true",
                        help="with --checkpoint: export the EMA of the weights saved beside them")
    parser.add_argument("--out", required=True, help="output file (megatron) or directory (hf)")


def _checkpoint_step(path: str) -> str:
    """The saved step ``path`` names (a run's checkpoint folder: its latest complete one)."""
    from moe_rl.orchestration import checkpoint
    if not os.path.isfile(os.path.join(path, checkpoint.MANIFEST)):
        latest = checkpoint.latest(path)
        if latest is None:
            raise checkpoint.CheckpointError(f"--checkpoint {path}: no complete checkpoint "
                                             f"there (expected iter_NNNNNNN folders or one)")
        path = latest
    checkpoint.verify(path)
    return path


def _layout(step_dir: str) -> dict:
    import json
    with open(os.path.join(step_dir, "layout.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _source_model(step_dir: str) -> str:
    """The HF model a run was trained from (``model.path`` of the checkpoint's config)."""
    import yaml
    with open(os.path.join(step_dir, "config.yaml"), encoding="utf-8") as fh:
        return yaml.safe_load(fh)["model"]["path"]


def run(args: argparse.Namespace) -> int:
    import torch
    from moe_rl.orchestration.checkpoint import CheckpointError
    from moe_rl.trainer.hf_weights import (load_hf_into_megatron, megatron_to_hf,
                                           save_hf_checkpoint)
    from moe_rl.trainer.model_builder import build_model, load_hf_config
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    from moe_rl.trainer.sharded_state import load_sharded_weights
    sources = [f for f in ("megatron", "checkpoint") if getattr(args, f)]
    if args.to == "hf" and len(sources) != 1:
        print("convert --to hf: give one of --megatron FILE or --checkpoint DIR")
        return 2
    if args.to == "megatron" and (sources or not args.hf):
        print("convert --to megatron: give --hf DIR (and neither --megatron nor --checkpoint)")
        return 2
    if args.ema and not args.checkpoint:
        print("convert --ema: only with --checkpoint")
        return 2
    step_dir = None
    if args.checkpoint:
        try:
            step_dir = _checkpoint_step(args.checkpoint)
        except CheckpointError as exc:
            print(f"convert: {exc}")
            return 2
    hf = args.hf or (_source_model(step_dir) if step_dir else None)
    if hf is None:
        print("convert --to hf --megatron: needs --hf DIR (the architecture)")
        return 2
    init_distributed()
    init_model_parallel()
    model, spec = build_model(hf)
    if args.to == "megatron":
        load_hf_into_megatron(model, spec, hf)
        torch.save({"model": model.state_dict(), "hf_config": load_hf_config(hf)}, args.out)
    else:
        if step_dir:
            if args.ema and not _layout(step_dir).get("ema"):
                print(f"convert --ema: {step_dir} was saved without an EMA "
                      f"(trainer.ema_decay unset)")
                return 2
            try:
                load_sharded_weights(os.path.join(step_dir, "trainer", "dist"), model,
                                     use_ema=args.ema)
            except Exception as exc:   # megatron names the key (another architecture)
                print(f"convert: cannot read the weights of {step_dir} into {hf}: {exc}")
                return 2
            print(f"read {step_dir}")
        else:   # tensors and plain containers only: a crafted file cannot run code
            state = torch.load(args.megatron, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])
        save_hf_checkpoint(megatron_to_hf(model, spec), spec, args.out, source_dir=hf)
    print(f"wrote {args.out}")
    return 0
