"""Packed (THD) rows on megatron-core's local layer spec.

Transformer Engine's attention takes a packed row as THD: the tokens of several sequences one
after another, ``cu_seqlens`` marking where each starts, attention causal inside each. megatron's
local ``DotProductAttention`` refuses packed parameters. :class:`PackedLocalAttention` accepts
them and attends each slot of ``cu_seqlens`` on its own with the local kernel, so a packed row
costs the sum of its slots' squared lengths (not the row's), and every other part of megatron's
THD path runs as on GPU: the rotary embedding restarting at each slot (``cu_seqlens``), the
[t, heads, dim] layout, the MoE layers on the row's tokens.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def slot_bounds(packed_seq_params) -> list[tuple[int, int]]:
    """[start, end) of every slot of a THD packed row (the padded ``cu_seqlens`` when given:
    each slot's padding belongs to it). Read once per row and kept on its parameters: every
    layer attends the same slots, and reading a GPU tensor waits for the device."""
    bounds = getattr(packed_seq_params, "moe_rl_slot_bounds", None)
    if bounds is None:
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        cu = cu.tolist()
        bounds = packed_seq_params.moe_rl_slot_bounds = list(zip(cu[:-1], cu[1:]))
    return bounds


class PackedLocalAttention(DotProductAttention):
    """megatron's local dot-product attention, also for THD packed rows (each slot causal on its
    own; queries, keys and values [t, heads, dim] -> [t, heads * dim])."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed rows: local attention takes the 'thd' format, got "
                             f"{packed_seq_params.qkv_format!r}")
        out = []
        for a, b in slot_bounds(packed_seq_params):
            causal = torch.triu(torch.ones(b - a, b - a, dtype=torch.bool, device=query.device),
                                diagonal=1)[None, None]
            part = super().forward(query[a:b, None], key[a:b, None], value[a:b, None], causal,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias)
            out.append(part[:, 0])
        return torch.cat(out)
