"""GLM-4.5 (GLM-4.5-Air, 4.6 and 4.7 share the layout): grouped-query attention with q/k/v
biases (``attention_bias``) and optional q/k RMSNorm (``use_qk_norm``), rotary embedding on the
first ``partial_rotary_factor`` of each head (not interleaved), DeepSeek-V3's router (sigmoid,
expert bias, group-limited top-k, ``routed_scaling_factor``) with shared experts, and
``first_k_dense_replace`` dense leading layers. The multi-token-prediction layers a released
checkpoint carries beyond ``num_hidden_layers`` are not trained. ``moe-rl init-model`` builds a
tiny one (``model.init.glm``, the router from ``model.init.deepseek``)."""
from __future__ import annotations

from moe_rl.errors import ConfigError
from moe_rl.families.names import gated_mlp_expert_names
from moe_rl.families.rope import check_tiny_partial_rotary, gpt_rotary
from moe_rl.families.sigmoid_router import (ROUTER_INIT_FIELDS, check_tiny_router,
                                            shared_expert_names, sigmoid_router_settings)

MODEL_TYPE = "glm4_moe"
TINY = True
HF_ROUTER = "mlp.gate"


def megatron_settings(spec, sizes, bias_update_rate: float) -> dict:
    """TransformerConfig settings of this family: the attention's biases and q/k norm, the
    router and the shared experts."""
    hf = spec.hf_config
    moe_ffn = int(hf["moe_intermediate_size"])
    return dict(ffn_hidden_size=int(hf.get("intermediate_size") or moe_ffn),
                moe_ffn_hidden_size=moe_ffn, moe_router_pre_softmax=False,
                add_qkv_bias=bool(hf.get("attention_bias")),
                qk_layernorm=bool(hf.get("use_qk_norm")),
                **sigmoid_router_settings(spec, bias_update_rate, "GLM-4.5"))


def rotary(hf: dict) -> dict:
    return gpt_rotary(hf)   # partial_rotary_factor: megatron's rotary_percent


def hf_attention_names(prefix: str) -> dict:
    """Rows of the megatron -> HF name table beyond the shared attention ones: the fused QKV
    bias, the shared experts."""
    a = prefix + "self_attn."
    return {"self_attention.linear_qkv.bias": ("qkv", [a + "q_proj.bias", a + "k_proj.bias",
                                                       a + "v_proj.bias"]),
            **shared_expert_names(prefix)}


def hf_expert_names(prefix: str) -> dict:
    return gated_mlp_expert_names(prefix)


def fp8_dense_mlp(hf: dict, experts: int) -> bool:
    return not experts or int(hf.get("first_k_dense_replace") or 0) > 0


def tiny_init_fields(fields: dict, sections: dict) -> dict:
    """The ``model.init`` fields under GLM-4.5's config.json names: ``model.init.glm`` and the
    router fields of ``model.init.deepseek`` (``sections``: the families' sections by name)."""
    fields.pop("decoder_sparse_step")
    router = {k: sections["deepseek"][k] for k in ROUTER_INIT_FIELDS}
    fields.update(sections["glm"], **router, n_routed_experts=fields.pop("num_experts"))
    return fields


def check_tiny_init(init) -> None:
    """model.init.glm and the router: a GLM-4.5 shape both transformers and megatron-core
    build."""
    if init.num_attention_heads % init.num_key_value_heads:
        raise ConfigError("model.init.num_key_value_heads: must divide model.init."
                          f"num_attention_heads ({init.num_attention_heads})")
    check_tiny_partial_rotary(init)
    check_tiny_router(init)


def tiny_hf_config(transformers, common: dict, fields: dict, init):
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta"),
                                 "partial_rotary_factor": fields.pop("partial_rotary_factor")}
    return transformers.Glm4MoeConfig(**common, num_mtp_layers=0, **fields)
