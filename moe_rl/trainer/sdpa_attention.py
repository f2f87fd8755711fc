"""Core attention through torch's fused kernel (``scaled_dot_product_attention``) on megatron-core's
local layer spec, in place of megatron's unfused ``DotProductAttention`` (two batched GEMMs and
a softmax over the whole [b, heads, s, s] score tensor, materialised).

:class:`SDPAttention` takes what megatron's core attention takes (queries [s, b, heads, dim],
grouped keys and values; no mask for causal rows, as the forwarder's are, or one that says
otherwise) and gives what it gives
([s, b, heads * value dim]): causal attention at megatron's softmax scale, grouped-query
attention without repeating the keys (``enable_gqa``), MLA's value heads narrower than its
query/key heads (the output follows the values), and packed (THD) rows, each slot causal on
its own: in one call of torch's variable-length attention where it runs
(``torch.nn.attention.varlen.varlen_attn``: CUDA, 16-bit, equal head sizes; :func:`varlen_kernel`
reads the installed torch's signature), slot by slot otherwise. torch picks the kernel:
FlashAttention or memory-efficient attention on a GPU, its fused CPU kernel here. Equal to the
local kernel within float32 rounding
(``tests/trainer/test_sdpa_attention.py``).

Where the local kernel stays (:func:`attention_unsupported`): attention sinks (gpt-oss's
learnable softmax offset) and sliding windows, which torch's kernel does not take.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from moe_rl.trainer.local_attention import slot_bounds


def attention_unsupported(config) -> str | None:
    """Why megatron-core ``config``'s attention stays on the local kernel (None: SDPA)."""
    if config.softmax_type != "vanilla":
        return f"attention sinks (softmax_type={config.softmax_type!r})"
    if config.window_size is not None:
        return "sliding-window layers"
    return None


def varlen_kernel():
    """torch's variable-length attention as ``f(q, k, v, cu, max_len, scale, gqa)`` (causal
    within each slot of the cumulative bounds ``cu``), or None where this torch has none or
    one whose causal switch it does not know (2.10's ``is_causal``, 2.13's ``window_size``)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    gqa = "enable_gqa" in params

    def attend(q, k, v, cu, max_len, scale, enable_gqa):
        if enable_gqa and not gqa:   # a torch whose kernel takes no grouped heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        extra = {"enable_gqa": True} if enable_gqa and gqa else {}
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal, **extra)
    return attend


VARLEN_DTYPES = (torch.bfloat16, torch.float16)


class SDPAttention(DotProductAttention):
    """megatron's core attention computed by ``torch.nn.functional.scaled_dot_product_attention``
    (see the module's doc); ``k_channels`` / ``v_channels``: MLA's head sizes (the output is as
    wide as the values given)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        # megatron divides its scale by the layer number under query-key layer scaling and
        # multiplies the scores back inside its softmax: the scores' scale is the same
        self.scale = self.softmax_scale * (self.layer_number
                                           if config.apply_query_key_layer_scaling else 1)
        self.dropout_p = (config.attention_dropout if attention_dropout is None
                          else attention_dropout)
        self._varlen = varlen_kernel()

    def _varlen_fits(self, query, value) -> bool:
        """Whether these packed rows go to the variable-length kernel (FlashAttention: CUDA,
        16-bit, the values' heads as wide as the queries', no dropout)."""
        return (query.is_cuda and query.dtype in VARLEN_DTYPES
                and query.shape[-1] == value.shape[-1] <= 256
                and not (self.training and self.dropout_p))

    def _attend(self, query, key, value, masked=None):
        """Attention of [b, heads, s, dim] queries on grouped keys and values: causal, or
        following ``masked`` (True = masked, megatron's convention) when given."""
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=None if masked is None else ~masked,
            is_causal=masked is None, scale=self.scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            enable_gqa=query.shape[1] != key.shape[1])

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """[sq, b, heads, dim] queries -> [sq, b, heads * value dim]; causal without a mask
        (the forwarder's rows, computed by the kernel itself), else as ``attention_mask``
        says."""
        if attention_bias is not None:
            raise ValueError("attention_bias: not taken by the SDPA core attention")
        if packed_seq_params is None:
            s, b = query.shape[:2]
            out = self._attend(*(t.permute(1, 2, 0, 3) for t in (query, key, value)),
                               attention_mask)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed rows: SDPA attention takes the 'thd' format, got "
                             f"{packed_seq_params.qkv_format!r}")
        bounds = slot_bounds(packed_seq_params)
        if self._varlen is not None and self._varlen_fits(query, value):
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            out = self._varlen(query, key, value, cu.to(torch.int32),
                               max(b - a for a, b in bounds), self.scale,
                               query.shape[1] != key.shape[1])
            return out.reshape(query.shape[0], -1)
        parts = []
        for a, b in bounds:   # [t, heads, dim] -> [1, heads, t, dim]
            out = self._attend(*(t[a:b].transpose(0, 1)[None] for t in (query, key, value)))
            parts.append(out[0].transpose(0, 1).reshape(b - a, -1))
        return torch.cat(parts)
