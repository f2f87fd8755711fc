"""MLA's query projection as DeepSeek's checkpoints define it, on every megatron-core release.

A model without query LoRA (``q_lora_rank: null``, DeepSeek-V2-Lite and Moonlight style) projects
the layer's normalised input straight to the queries: HF's ``q_proj`` has no norm of its own.
megatron-core 0.16 builds exactly that. From 0.17 on, MLA resolves its norms in
``_resolve_qk_norm_config`` (``QKNormConfigResolver``), which under ``qk_layernorm`` (needed for
the KV latent's norm) gives the query projection a fused norm of its own on Transformer
Engine's spec (a second norm the checkpoint does not have, with a weight it does not hold) and
refuses the local spec outright. :class:`HFQueryMLASelfAttention` resolves the KV side as
megatron does and builds the query projection as a plain linear layer; it is used only where
the model has no query LoRA and megatron-core resolves its norms so (a feature test, not a
version test)."""
from __future__ import annotations

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


def resolves_qk_norms() -> bool:
    """Whether this megatron-core resolves MLA's Q/KV norms itself (0.17 and later)."""
    return hasattr(MLASelfAttention, "_resolve_qk_norm_config")


class HFQueryMLASelfAttention(MLASelfAttention):
    """MLA whose query projection (no query LoRA) has no norm: the checkpoint's ``q_proj``."""

    def _resolve_qk_norm_config(self, submodules):
        from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
        resolver = QKNormConfigResolver(self.config, submodules)
        # the KV side resolves as it does beside a query LoRA; the query LoRA's own slots are
        # then left unused (this model has none)
        resolver.has_q_lora = True
        resolved = resolver.resolve()
        resolved.update(linear_q_proj=submodules.linear_q_proj or resolver.linear_impl,
                        linear_q_up_proj=IdentityOp, q_layernorm=IdentityOp)
        return resolved


def use_hf_query_projection(block_spec) -> None:
    """In a decoder block spec of an MLA model without query LoRA: build MLA with the
    checkpoint's query projection where megatron-core would add a norm to it (in place)."""
    if not resolves_qk_norms():
        return
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention:
            attention.module = HFQueryMLASelfAttention
