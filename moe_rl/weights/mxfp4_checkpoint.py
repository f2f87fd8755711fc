"""Released MXFP4 checkpoints (gpt-oss's: ``quantization_config`` {quant_method: mxfp4}), read
dequantised. Such a checkpoint stores each stacked expert tensor ``X`` [E, in, out] as
``X_blocks`` [E, out, in / 32, 16] (uint8: two E2M1 codes a byte, the lower nibble the earlier
element; a code's bit 3 is its sign, bits 0-2 its magnitude ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}) and
``X_scales`` [E, out, in / 32] (uint8: E8M0 exponents, 127 meaning 2^0); every other tensor is
plain. The trainer reads one as the model those values make (exactly: every MXFP4 value is a
bfloat16 value) and trains that model in its own precision; the engines serve a bfloat16 copy
(:func:`moe_rl.weights.hf.write_dequantised_mxfp4`), since every weight update hands them
unquantised tensors."""
from __future__ import annotations

import json
import os

import torch

from moe_rl.families.shape import unquantised_config
from moe_rl.weights.mxfp4 import BLOCK, E2M1

BLOCKS, SCALES = "_blocks", "_scales"
E8M0_BIAS = 127


def transformers_dequantising(model_dir: str) -> dict:
    """``from_pretrained`` keywords that load an MXFP4 release dequantised: transformers 5.25
    (its ``kernels`` package a dependency) otherwise fetches Triton kernels from the Hub where
    triton is installed, CPU included (offline: a refusal)."""
    if not is_mxfp4_checkpoint(model_dir):
        return {}
    from transformers import Mxfp4Config
    return {"quantization_config": Mxfp4Config(dequantize=True)}


def is_mxfp4_checkpoint(model_dir: str) -> bool:
    """Whether ``model_dir``'s config.json declares MXFP4 weights."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
            hf = json.load(fh)
    except (OSError, ValueError):
        return False
    return unquantised_config(hf) is not hf


def dequantise(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``X`` [..., in, out] from ``X_blocks`` [..., out, in / 32, 16] and ``X_scales`` [..., out,
    in / 32] (ValueError when their shapes do not pair)."""
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8
            or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales "
                         f"{list(scales.shape)} ({scales.dtype}) do not pair: expected uint8 "
                         f"[..., groups, {BLOCK // 2}] and uint8 [..., groups]")
    codes = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
    values = torch.stack([codes[(blocks & 0x0F).long()], codes[(blocks >> 4).long()]], dim=-1)
    exponent = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values.flatten(-2), exponent[..., None])   # [..., out, groups, 32]
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def stacked_name(name: str) -> str | None:
    """``X`` for the tensor name ``X_blocks`` (None for any other name)."""
    return name[:-len(BLOCKS)] if name.endswith(BLOCKS) else None
