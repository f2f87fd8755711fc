"""FP8 rollout numerics for the reference engine (``--quantization fp8``), emulated exactly:

- weights of every linear layer SGLang quantises (attention projections, dense and shared-expert
  MLPs, the routed experts) stored as E4M3 (``torch.float8_e4m3fn``) in 128 x 128 blocks with one
  float32 scale per block, ``scale = amax(|block|) / 448``; re-quantised from the served weights at
  every load, so every weight update is quantised afresh;
- activations quantised per token in groups of 128 input features (scale ``amax / 448`` each)
  before each such matmul;
- products accumulated in float32 (the dequantised operands multiplied in float32), the output
  rounded to the engine's dtype.

Left unquantised, as by SGLang: the router gates (its MoE gate is built without a quantisation
config), the embeddings, the LM head and every norm.
"""
from __future__ import annotations

import types

import torch
from torch import nn

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
        pad = torch.zeros(_blocks(N) * BLOCK, _blocks(K) * BLOCK)
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
    """The nn.Linear layers SGLang's FP8 path quantises: all but the LM head and router gates."""
    leaf = name.rsplit(".", 1)[-1]
    return isinstance(module, nn.Linear) and leaf not in ("lm_head", "gate")


def apply_fp8(model: nn.Module) -> int:
    """Quantise ``model``'s weights (see the module docstring) and route its quantised layers
    through FP8 matmuls; returns the number of weight matrices quantised."""
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if is_quantised_linear(name, module):
                module.fp8_weight = _quantized(module.weight)
                module.forward = types.MethodType(_linear_forward, module)
                count += 1
            elif isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and \
                    isinstance(getattr(module, "down_proj", None), nn.Parameter):
                module.fp8_gate_up = torch.stack([_quantized(w) for w in module.gate_up_proj])
                module.fp8_down = torch.stack([_quantized(w) for w in module.down_proj])
                module.forward = types.MethodType(_experts_forward, module)
                count += 2 * module.gate_up_proj.shape[0]
    return count
