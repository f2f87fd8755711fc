"""MXFP4 (OCP Microscaling, FP4 E2M1 elements): blocks of 32 consecutive values along a weight's
input dimension share one power-of-two scale (E8M0); each element is one of the 16 E2M1 codes
±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. The scale of a block is 2^(floor(log2(amax)) - 2) (2: the exponent
of E2M1's largest normal, so the block's largest value lands in [4, 8)), elements round to the
nearest code, ties to the even code, and saturate at ±6. Used by the reference engine's
``rollout.quantization: mxfp4`` to emulate 4-bit rollout weights exactly (weights only; the
layers quantised are those of the FP8 path: :func:`moe_rl.weights.fp8.quantised_weight_name`)."""
from __future__ import annotations

import torch

BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitude codes 0..7 (odd code = odd mantissa)
EMAX_ELEM = 2
SCALE_EXP_RANGE = (-127, 127)   # E8M0


def block_scale_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """The shared exponent of each block (last dimension): floor(log2(amax)) - 2, clamped to
    E8M0's range; an all-zero block takes the smallest exponent."""
    amax = blocks.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    exp = torch.floor(torch.log2(safe)) - EMAX_ELEM
    exp = torch.where(amax > 0, exp, torch.full_like(exp, SCALE_EXP_RANGE[0]))
    return exp.clamp(*SCALE_EXP_RANGE)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Each value to the nearest E2M1 code (ties to the even code), saturated at ±6."""
    grid = torch.tensor(E2M1, dtype=v.dtype, device=v.device)
    mag = v.abs().clamp(max=E2M1[-1])
    dist = (mag[..., None] - grid).abs()
    idx = dist.argmin(-1)                                  # the lower code on a tie
    up = (idx + 1).clamp(max=len(E2M1) - 1)
    tie = (dist.gather(-1, up[..., None]) == dist.gather(-1, idx[..., None])).squeeze(-1)
    idx = torch.where(tie & (idx % 2 == 1), up, idx)       # ties go to the even code
    return torch.sign(v) * grid[idx]


def mxfp4_round_trip(w: torch.Tensor) -> torch.Tensor:
    """``w`` quantised to MXFP4 along its last dimension and dequantised, in ``w``'s dtype
    (computed in float32; a last block shorter than 32 is its own block)."""
    K = w.shape[-1]
    x = w.float()
    pad = (-K) % BLOCK
    g = torch.nn.functional.pad(x, (0, pad)).view(*x.shape[:-1], -1, BLOCK)
    scale = torch.exp2(block_scale_exponents(g))
    out = (round_to_e2m1(g / scale) * scale).view(*x.shape[:-1], -1)[..., :K]
    return out.to(w.dtype)
