"""Model families: everything that differs between the MoE architectures moe_rl trains, one
module per family, found by the HF ``config.json``'s ``model_type``:

- the megatron-core settings (:func:`megatron_settings`; ``MULTI_LATENT_ATTENTION`` picks
  MLATransformerConfig) and the rotary embedding the GPTModel builds (:func:`rotary`);
- the HF <-> megatron name table (``HF_MOE_BLOCK``, ``HF_EXPERT``, :func:`hf_attention_names`);
- the shapes SGLang's FP8 loader checks (:func:`fp8_head_dim`, :func:`fp8_moe_intermediate`,
  :func:`fp8_dense_mlp`) and the tensors it loads only together (:func:`engine_fused_key`);
- the tiny CPU model of ``moe-rl init-model`` (:func:`tiny_init_fields`, :func:`check_tiny_init`,
  :func:`tiny_hf_config`; ``TINY`` says whether the family has one).

A new family is one module here and one line in :data:`FAMILIES`."""
from __future__ import annotations

from types import ModuleType

from moe_rl.families import deepseek_v3, glm4_moe, mixtral, qwen3_moe

FAMILIES: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (qwen3_moe, mixtral, deepseek_v3,
                                                               glm4_moe)}
SUPPORTED = tuple(FAMILIES)
TINY_FAMILIES = tuple(t for t, m in FAMILIES.items() if m.TINY)   # `moe-rl init-model` builds


def family(model_type: str | None) -> ModuleType:
    """The family module of ``model_type`` (ValueError naming the supported ones)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: {model_type!r} is not supported; supported: {SUPPORTED}")
    return FAMILIES[model_type]
