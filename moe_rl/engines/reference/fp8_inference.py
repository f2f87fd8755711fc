"""The reference engine's exact emulation of SGLang's block-wise FP8 inference
(``--quantization fp8``, or an FP8 checkpoint): the weights SGLang quantises
(:func:`moe_rl.weights.fp8.quantised_weight_name`) block-dequantised, activations quantised per
token in groups of 128 features, float32 accumulation, output in the engine's dtype."""
from __future__ import annotations

import types

import torch
from torch import nn

from moe_rl.weights.fp8 import (BLOCK, E4M3_MAX, _TINY, _blocks, dequantize_blockwise,
                                quantize_blockwise, quantised_weight_name)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """Per token, groups of 128 features along the last dimension quantised to E4M3 with scale
    amax/448 each; returned dequantised (float32)."""
    K = x.shape[-1]
    x = x.float()
    pad = torch.nn.functional.pad(x, (0, _blocks(K) * BLOCK - K))
    g = pad.view(*x.shape[:-1], _blocks(K), BLOCK)
    scale = (g.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(_TINY)
    deq = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return deq.view(*x.shape[:-1], -1)[..., :K]


def fp8_linear(x: torch.Tensor, w_deq: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``x W^T (+ b)`` with x quantised per token group, W already block-dequantised, float32
    accumulation, output in x's dtype."""
    y = torch.matmul(quantize_activations(x), w_deq.t())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _quantized(w: torch.Tensor) -> torch.Tensor:
    return dequantize_blockwise(*quantize_blockwise(w))


def _linear_forward(self, x):
    return fp8_linear(x, self.fp8_weight, self.bias)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Routed experts with FP8 matmuls: token t's output is sum_k w_tk E_{i_tk}(x_t)."""
    out = torch.zeros_like(hidden_states)
    for e in top_k_index.unique().tolist():
        if e >= self.fp8_gate_up.shape[0]:
            continue
        token, slot = torch.where(top_k_index == e)
        x = hidden_states[token]
        gate, up = fp8_linear(x, self.fp8_gate_up[e]).chunk(2, dim=-1)
        y = fp8_linear(self.act_fn(gate) * up, self.fp8_down[e])
        out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def is_quantised_linear(name: str, module: nn.Module) -> bool:
    """The nn.Linear layers SGLang's FP8 path quantises (:func:`quantised_weight_name` of their
    weight)."""
    return isinstance(module, nn.Linear) and quantised_weight_name(f"{name}.weight",
                                                                   module.weight)


def apply_fp8(model: nn.Module, exact: dict[str, torch.Tensor] | None = None) -> int:
    """Quantise ``model``'s weights (see the module docstring) and route its quantised layers
    through FP8 matmuls; ``exact``: the dequantised weights of an FP8 checkpoint by HF name,
    used as they are (the model's own copies went through its dtype). Returns the number of
    weight matrices quantised."""
    exact = exact or {}

    def weight(name: str, w: torch.Tensor) -> torch.Tensor:
        return exact[name] if name in exact else _quantized(w)
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if is_quantised_linear(name, module):
                module.fp8_weight = weight(f"{name}.weight", module.weight)
                module.forward = types.MethodType(_linear_forward, module)
                count += 1
            elif (isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and
                    isinstance(getattr(module, "down_proj", None), nn.Parameter)):
                gate_up, down = [], []
                for e, (gu, dn) in enumerate(zip(module.gate_up_proj, module.down_proj)):
                    pair = (f"{name}.{e}.gate_proj.weight", f"{name}.{e}.up_proj.weight")
                    gate_up.append(torch.cat([exact[k] if k in exact else _quantized(half)
                                              for k, half in zip(pair, gu.chunk(2, dim=0))]))
                    down.append(weight(f"{name}.{e}.down_proj.weight", dn))
                module.fp8_gate_up, module.fp8_down = torch.stack(gate_up), torch.stack(down)
                module.forward = types.MethodType(_experts_forward, module)
                count += 2 * len(gate_up)
    return count
