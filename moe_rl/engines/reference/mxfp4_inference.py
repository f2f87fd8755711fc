"""The reference engine's MXFP4 rollout weights (``--quantization mxfp4``): every weight the FP8
path quantises (linear layers and routed experts; not router gates, embeddings, the LM head or
norms; not biases) is replaced by its MXFP4 round trip
(:func:`moe_rl.weights.mxfp4.mxfp4_round_trip`, blocks along each matrix's input dimension), at
every load; the matmuls then run in the engine's dtype on those values."""
from __future__ import annotations

import torch
from torch import nn

from moe_rl.engines.reference.fp8_inference import is_quantised_linear
from moe_rl.weights.mxfp4 import mxfp4_round_trip


def apply_mxfp4(model: nn.Module) -> int:
    """Quantise ``model``'s weights to MXFP4 in place; returns the number of weight matrices
    quantised (a routed expert's gate-up and down projections count two)."""
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if is_quantised_linear(name, module):
                module.weight.copy_(mxfp4_round_trip(module.weight))
                count += 1
            elif (isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and
                    isinstance(getattr(module, "down_proj", None), nn.Parameter)):
                # [E, out, in]; transformers marks experts stacked [E, in, out] (gpt-oss's)
                # is_transposed: their blocks run along dim -2, as gpt-oss's release holds them
                transposed = getattr(module, "is_transposed", False)
                for param in (module.gate_up_proj, module.down_proj):
                    param.copy_(mxfp4_round_trip(param.transpose(-1, -2)).transpose(-1, -2)
                                if transposed else mxfp4_round_trip(param))
                count += 2 * module.gate_up_proj.shape[0]
    return count
