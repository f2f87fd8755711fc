"""The block-wise FP8 weight format of FP8 rollouts (what SGLang serves; the reference engine's
emulation of FP8 inference is :mod:`moe_rl.engines.reference.fp8_inference`):

- weights of every linear layer SGLang quantises (attention projections, dense and shared-expert
  MLPs, the routed experts) stored as E4M3 (``torch.float8_e4m3fn``) in 128 x 128 blocks with one
  float32 scale per block, ``scale = amax(|block|) / 448``; re-quantised from the served weights at
  every load, so every weight update is quantised afresh. Blocks are cut per HF weight (an
  expert's gate and up projections each on their own, also where the model fuses them), so
  online quantisation and an FP8 checkpoint of the same weights give the same values;
- activations quantised per token in groups of 128 input features (scale ``amax / 448`` each)
  before each such matmul;
- products accumulated in float32 (the dequantised operands multiplied in float32), the output
  rounded to the engine's dtype.

Left unquantised, as by SGLang: the router gates (its MoE gate is built without a quantisation
config), the embeddings, the LM head and every norm.

FP8 checkpoints (``rollout.quantization: fp8``): the HF checkpoint with every quantised weight
``X.weight`` stored as E4M3 plus ``X.weight_scale_inv`` (float32, one per 128 x 128 block, the
factor that multiplies the E4M3 values back) and ``quantization_config`` {quant_method fp8,
dynamic activations, weight_block_size [128, 128]} in config.json: the format SGLang serves
block-wise FP8 from (its block quantisation takes FP8-serialised checkpoints only) and takes in
weight updates. moe_rl quantises the trainer's weights into it for the engines' start and for
every weight update, on every sync path.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

E4M3_MAX = 448.0
BLOCK = 128
_TINY = torch.finfo(torch.float32).tiny


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize_blockwise(w: torch.Tensor, scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (E4M3 values [N, K], float32 scales [ceil(N/128), ceil(K/128)]); with no
    ``scale`` given, each block's is amax/448 (values beyond +-448 after scaling saturate)."""
    N, K = w.shape
    w = w.float()
    if scale is None:
        pad = w.new_zeros(_blocks(N) * BLOCK, _blocks(K) * BLOCK)
        pad[:N, :K] = w.abs()
        amax = pad.view(_blocks(N), BLOCK, _blocks(K), BLOCK).amax(dim=(1, 3))
        scale = (amax / E4M3_MAX).clamp_min(_TINY)
    full = scale.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise` (float32)."""
    N, K = q.shape
    full = scale.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return q.float() * full


def read_fp8_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """The dequantised (float32) weights of an FP8 checkpoint's quantised tensors, by name."""
    raw = _read_all(model_dir)
    return {name: dequantize_blockwise(t, raw[name[:-len("weight")] + SCALE_SUFFIX])
            for name, t in raw.items()
            if name.endswith(".weight") and name[:-len("weight")] + SCALE_SUFFIX in raw}


QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
SCALE_SUFFIX = "weight_scale_inv"


UNQUANTISED_MODULES = ("gate", "lm_head", "embed_tokens")


def quantised_weight_name(name: str, tensor: torch.Tensor) -> bool:
    """Whether SGLang's FP8 path quantises the HF weight ``name``: the 2-D ``.weight`` of a linear
    layer, not a router gate (Qwen3-MoE and DeepSeek-V3 ``mlp.gate``, Mixtral
    ``block_sparse_moe.gate``: SGLang builds every MoE gate unquantised), the embeddings, the LM
    head or a norm. The one predicate of the FP8 writer, every FP8 sync and the reference
    engine."""
    if not name.endswith(".weight") or tensor.dim() != 2:
        return False
    leaf = name[:-len(".weight")].rsplit(".", 1)[-1]
    return leaf not in UNQUANTISED_MODULES and "norm" not in leaf


def quantise_named(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors in the FP8 checkpoint's form: each quantised weight becomes its E4M3
    values and its ``weight_scale_inv`` (the others pass unchanged)."""
    out = []
    for name, t in named:
        if quantised_weight_name(name, t):
            q, scale = quantize_blockwise(t)
            out += [(name, q), (name[:-len("weight")] + SCALE_SUFFIX, scale)]
        else:
            out.append((name, t))
    return out


def is_fp8_checkpoint(model_dir: str) -> bool:
    """Whether ``model_dir``'s config.json declares block-wise FP8 weights."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
            q = json.load(fh).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return q.get("quant_method") == "fp8"


def _read_all(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for fname in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        out.update(load_file(os.path.join(model_dir, fname)))
    return out


def _write(tensors: dict[str, torch.Tensor], src: str, dst: str, config_edit) -> str:
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    for fname in os.listdir(src):   # tokenizer, generation config, chat template
        if (fname.endswith(".json") or fname.endswith(".jinja")) and fname not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(os.path.join(src, fname), dst)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    config_edit(config)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(dst, "model.safetensors"))
    return dst


def write_fp8_checkpoint(src: str, dst: str) -> str:
    """The HF checkpoint ``src`` quantised into an FP8 checkpoint at ``dst``; returns ``dst``."""
    tensors = dict(quantise_named(list(_read_all(src).items())))
    return _write(tensors, src, dst,
                  lambda c: c.__setitem__("quantization_config", dict(QUANTIZATION_CONFIG)))


def write_dequantised_checkpoint(src: str, dst: str, dtype: torch.dtype) -> str:
    """The FP8 checkpoint ``src`` with its weights multiplied back (``dtype``), a plain HF
    checkpoint at ``dst`` that any loader reads; returns ``dst``."""
    raw = _read_all(src)
    tensors = {}
    for name, t in raw.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = (raw.get(name[:-len("weight")] + SCALE_SUFFIX) if name.endswith(".weight")
            else None)
        tensors[name] = (dequantize_blockwise(t, scale) if scale is not None else t).to(dtype)
    return _write(tensors, src, dst, lambda c: c.pop("quantization_config", None))
