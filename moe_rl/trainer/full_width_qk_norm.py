"""A q/k RMSNorm over all heads of the projection at once (MiniMax-M2's ``qk_norm_type:
per_layer``: ``q_norm(q_proj(x))`` with one weight of heads x head_dim), which megatron-core
does not build: its ``qk_layernorm`` normalises each head alone. The attention hands its norm
the query [s, b, heads, head_dim] (the key [s, b, groups, head_dim]) in the checkpoint's head
order, so this norm takes the mean square over the last two dimensions and scales by its
weight laid out as them. Without tensor parallelism only (each rank would hold a share of the
heads and need the others' squares)."""
from __future__ import annotations

import torch
from torch import nn


class FullWidthRMSNorm(nn.Module):
    """RMSNorm over the last two dimensions ([..., heads, head_dim]) with a weight of
    heads x head_dim, computed in float32 and cast back before the weight, as transformers'
    RMSNorm."""

    def __init__(self, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(heads * head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean((-2, -1), keepdim=True) + self.eps)
        return self.weight.view(self.heads, self.head_dim) * h.to(x.dtype)


class FullWidthQueryNorm(FullWidthRMSNorm):
    """The query's: megatron-core builds it as ``q_layernorm(hidden_size=head_dim, config,
    eps)``."""

    def __init__(self, hidden_size: int, config, eps: float):
        super().__init__(config.num_attention_heads, hidden_size, eps)


class FullWidthKeyNorm(FullWidthRMSNorm):
    """The key's, over the key/value heads (``num_query_groups``)."""

    def __init__(self, hidden_size: int, config, eps: float):
        super().__init__(config.num_query_groups, hidden_size, eps)


def use_full_width_qk_norm(block) -> None:
    """Every layer of the decoder block spec ``block`` normalises its query and key over all
    heads at once (in place)."""
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm, attention.k_layernorm = FullWidthQueryNorm, FullWidthKeyNorm
