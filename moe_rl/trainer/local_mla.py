"""Multi-head Latent Attention on megatron-core's local (non Transformer Engine) layer spec.

megatron-core 0.16 builds MLA's core attention with separate key and value head sizes
(``k_channels``, ``v_channels``), which only Transformer Engine's attention accepts; its local
``DotProductAttention`` takes neither and shapes its output as ``kv_channels`` per head. And
without Transformer Engine installed, the MLA module still believes TE is present (megatron's
extension module imports with a stand-in), so its ``isinstance(..., TELinear)`` check fails.
From 0.17 on, MLA pads the values of packed rows to the query/key width; the output follows the
width of the values it is given.
:func:`use_local_mla` fixes both for a block spec built with ``use_transformer_engine=False``.
"""
from __future__ import annotations

import importlib.util

from megatron.core.transformer.dot_product_attention import DotProductAttention

from moe_rl.trainer.local_attention import PackedLocalAttention


class LocalMLACoreAttention(PackedLocalAttention):
    """megatron's local dot-product attention (packed rows too) with MLA's head sizes: queries and
    keys of ``k_channels`` (nope + rope dims), values and output of ``v_channels`` per head. The
    softmax scale is the one MLA passes (YaRN's mscale included)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:   # the output is [s, b, heads_per_partition * v_channels]
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """The output is as wide as the values given: megatron-core 0.17+ pads MLA's values to
        the query/key width on packed rows (and trims the output after)."""
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * value.shape[-1]
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias,
                               packed_seq_params=packed_seq_params)


def use_local_mla(block_spec) -> None:
    """Make a local-spec decoder block ``block_spec`` with MLA buildable and correct (in place)."""
    if importlib.util.find_spec("transformer_engine") is None:
        import megatron.core.transformer.multi_latent_attention as mla
        mla.HAVE_TE = False
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = LocalMLACoreAttention
