"""``moe-rl convert``: Hugging Face <-> Megatron checkpoints (single process, CPU or one GPU).

  moe-rl convert --to megatron --hf DIR --out FILE.pt
  moe-rl convert --to hf --megatron FILE.pt --hf DIR --out DIR2

A Megatron file holds ``{"model": megatron state_dict, "hf_config": dict}``; a trainer
checkpoint (``checkpoints/trainer.pt.rank0``, its ``model`` entry) converts to HF the same way.
``--hf`` gives the architecture (config.json) and the tokenizer files copied to the output.
"""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", choices=["megatron", "hf"], required=True)
    parser.add_argument("--hf", required=True, help="HF model directory (source, or architecture)")
    parser.add_argument("--megatron", help="Megatron file to convert to HF (--to hf)")
    parser.add_argument("--out", required=True, help="output file (megatron) or directory (hf)")


def run(args: argparse.Namespace) -> int:
    import torch
    from moe_rl.trainer.hf_weights import (load_hf_into_megatron, megatron_to_hf,
                                           save_hf_checkpoint)
    from moe_rl.trainer.model_builder import build_model, load_hf_config
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    model, spec = build_model(args.hf)
    if args.to == "megatron":
        load_hf_into_megatron(model, spec, args.hf)
        torch.save({"model": model.state_dict(), "hf_config": load_hf_config(args.hf)}, args.out)
    else:
        if not args.megatron:
            print("convert --to hf: needs --megatron FILE")
            return 2
        # tensors and plain containers only: a crafted file cannot run code
        state = torch.load(args.megatron, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        save_hf_checkpoint(megatron_to_hf(model, spec), spec, args.out, source_dir=args.hf)
    print(f"wrote {args.out}")
    return 0
