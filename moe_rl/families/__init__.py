"""Model families: everything that differs between the MoE architectures moe_rl trains, one
module per family, found by the HF ``config.json``'s ``model_type``:

- the megatron-core settings (:func:`megatron_settings`; ``MULTI_LATENT_ATTENTION`` picks
  MLATransformerConfig) and the rotary embedding the GPTModel builds (:func:`rotary`);
- the HF <-> megatron name table (``HF_ROUTER``, :func:`hf_expert_names`,
  :func:`hf_attention_names`);
- the shapes SGLang's FP8 loader checks (:func:`fp8_head_dim`, :func:`fp8_moe_intermediate`,
  :func:`fp8_dense_mlp`) and the tensors it loads only together (:func:`engine_fused_key`);
- the tiny CPU model of ``moe-rl init-model`` (:func:`tiny_init_fields`, :func:`check_tiny_init`,
  :func:`tiny_hf_config`; ``TINY`` says whether the family has one).

A family whose runs cannot take every option refuses them in an optional
``check_config(cfg, hf)``, run when the configuration is loaded.

A new family is one module here and one line in :data:`FAMILIES`; what it leaves out it takes
from :mod:`moe_rl.families.defaults` (so a new trait or hook edits that module and the
families that differ, not every family). A checkpoint of a family's
layout under its own ``model_type`` (Kimi-K2's ``kimi_k2``, DeepSeek-V3's code shipped beside
it) is one name in its module's ``OTHER_MODEL_TYPES``: transformers then builds it by the
family's own type (:func:`transformers_config`)."""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Family(Protocol):
    """What a family module holds (each is checked against it: ``tests/toplevel/test_layout.py``);
    ``OTHER_MODEL_TYPES``, where present, names the other ``model_type`` values it reads."""
    MODEL_TYPE: str
    MULTI_LATENT_ATTENTION: bool   # megatron-core's MLATransformerConfig
    ATTENTION_SINKS: bool          # a learned sink logit per head (softmax_type: learnable)
    QK_NORM_ACROSS_HEADS: bool     # q/k RMSNorm over all heads at once (trainer/full_width_qk_norm)
    TINY: bool                     # `moe-rl init-model` builds one (then :class:`TinyFamily`)
    HF_ROUTER: str                 # a MoE layer's router module under ``model.layers.{i}.``

    def megatron_settings(self, spec, sizes, bias_update_rate: float) -> dict: ...
    def rotary(self, hf: dict) -> dict: ...
    def hf_attention_names(self, prefix: str) -> dict: ...
    def hf_expert_names(self, prefix: str) -> dict: ...
    def engine_fused_key(self, hf: dict, name: str) -> str | None: ...
    def fp8_head_dim(self, hf: dict, heads: int) -> int | None: ...
    def fp8_moe_intermediate(self, hf: dict) -> int: ...
    def fp8_dense_mlp(self, hf: dict, experts: int) -> bool: ...


@runtime_checkable
class TinyFamily(Family, Protocol):
    """A family with a tiny CPU model of ``moe-rl init-model``."""

    def tiny_init_fields(self, fields: dict, sections: dict) -> dict: ...
    def check_tiny_init(self, init) -> None: ...
    def tiny_hf_config(self, transformers, common: dict, fields: dict, init): ...


def with_defaults(module):
    """Family ``module`` with every name of :data:`moe_rl.families.defaults.DEFAULTS` it does
    not define taken from there (in place); returns it."""
    from moe_rl.families import defaults
    for name in defaults.DEFAULTS:
        if not hasattr(module, name):
            setattr(module, name, getattr(defaults, name))
    return module


from moe_rl.families import (deepseek_v3, glm4_moe, gpt_oss, minimax_m2, mixtral,  # noqa: E402
                             qwen3_moe)

FAMILIES: dict[str, Family] = {
    t: with_defaults(m) for m in (qwen3_moe, mixtral, deepseek_v3, glm4_moe, gpt_oss, minimax_m2)
    for t in (m.MODEL_TYPE, *getattr(m, "OTHER_MODEL_TYPES", ()))}
SUPPORTED = tuple(FAMILIES)
TINY_FAMILIES = tuple(t for t, m in FAMILIES.items()   # `moe-rl init-model` builds
                      if m.TINY and t == m.MODEL_TYPE)


def family(model_type: str | None) -> Family:
    """The family module of ``model_type`` (ValueError naming the supported ones)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: {model_type!r} is not supported; supported: {SUPPORTED}")
    return FAMILIES[model_type]


def transformers_config(hf: dict):
    """transformers' config of the config.json ``hf``, built by its family's own model type (a
    ``kimi_k2`` checkpoint's needs the code shipped beside it otherwise, which is never run)."""
    from transformers import AutoConfig
    fields = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", "auto_map")}
    return AutoConfig.for_model(family(hf.get("model_type")).MODEL_TYPE, **fields)
