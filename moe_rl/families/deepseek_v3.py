"""DeepSeek-V3 (and models of its layout: Kimi-K2, whose config.json says ``kimi_k2``; Moonlight):
Multi-head Latent Attention, a sigmoid router with expert bias and group-limited top-k, shared
experts, leading dense layers (``first_k_dense_replace``)."""
from __future__ import annotations

from moe_rl.errors import ConfigError
from moe_rl.families.names import gated_mlp_expert_names
from moe_rl.families.rope import rope_table
from moe_rl.families.sigmoid_router import (check_tiny_router, shared_expert_names,
                                            sigmoid_router_settings)

MODEL_TYPE = "deepseek_v3"
OTHER_MODEL_TYPES = ("kimi_k2",)   # Kimi-K2: DeepseekV3ForCausalLM, 384 experts, one group, YaRN
MULTI_LATENT_ATTENTION = True
TINY = True
HF_ROUTER = "mlp.gate"


def megatron_settings(spec, sizes, bias_update_rate: float) -> dict:
    """MLATransformerConfig settings of this family: MLA, the router, the shared experts."""
    hf = spec.hf_config
    moe_ffn = int(hf["moe_intermediate_size"])
    return dict(ffn_hidden_size=int(hf.get("intermediate_size") or moe_ffn),
                moe_ffn_hidden_size=moe_ffn, moe_router_pre_softmax=False,
                qk_layernorm=True,   # MLA's q_a_layernorm / kv_a_layernorm
                **_mla_and_router(spec, sizes, bias_update_rate))


def rotary(hf: dict) -> dict:
    return dict(position_embedding_type="none")   # MLA applies its own rotary embedding


def mla_rope_settings(hf: dict) -> dict:
    """MLATransformerConfig rotary settings of a DeepSeek-V3 config: default RoPE or YaRN (factor,
    original context, beta fast/slow, mscale, mscale_all_dim); other scalings are refused."""
    params, scaling = rope_table(hf)
    table = {**scaling, **params}
    kind = table.get("rope_type", table.get("type", "default"))
    theta = float(table.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind in ("default", None):
        return dict(rope_type="rope", rotary_base=theta, rotary_scaling_factor=1.0,
                    mscale_all_dim=0.0)
    if kind != "yarn":
        raise ValueError(f"rope_parameters.rope_type: {kind!r} is not supported for DeepSeek-V3 "
                         f"(megatron-core's MLA builds 'default' and 'yarn')")
    return dict(rope_type="yarn", rotary_base=theta,
                rotary_scaling_factor=float(table["factor"]),
                original_max_position_embeddings=int(table.get(
                    "original_max_position_embeddings") or hf["max_position_embeddings"]),
                beta_fast=float(table.get("beta_fast") or 32.0),
                beta_slow=float(table.get("beta_slow") or 1.0),
                mscale=float(table.get("mscale") or 1.0),
                mscale_all_dim=float(table.get("mscale_all_dim") or 0.0))


def _mla_and_router(spec, sizes, bias_update_rate: float) -> dict:
    """The MLA and router settings of a DeepSeek-V3 config; what megatron-core cannot compute
    the same way is refused naming the field."""
    hf = spec.hf_config
    refuse = {
        "attention_bias": (bool(hf.get("attention_bias")), "attention biases are not built"),
        "rope_interleave": (hf.get("rope_interleave", True) is False,
                            "megatron-core's MLA rotates interleaved pairs only"),
    }
    for key, (bad, why) in refuse.items():
        if bad:
            raise ValueError(f"{key}: {hf.get(key)!r} is not supported for DeepSeek-V3: {why}")
    router = sigmoid_router_settings(spec, bias_update_rate, "DeepSeek-V3")
    if sizes.tensor > 1:
        raise ValueError("trainer.parallel.tensor: > 1 is not supported for DeepSeek-V3 (MLA) "
                         "models yet; use expert and data parallelism")
    return dict(
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=int(hf["kv_lora_rank"]), qk_head_dim=int(hf["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
        kv_channels=int(hf["v_head_dim"]), **mla_rope_settings(hf), **router)


def hf_expert_names(prefix: str) -> dict:
    return gated_mlp_expert_names(prefix)


def hf_attention_names(prefix: str) -> dict:
    """MLA's rows of the megatron -> HF name table (local spec names; TE fuses the norms into
    the up projections). ``prefix``: the layer's ``model.layers.{i}.``."""
    a = prefix + "self_attn."
    q_norm = ("copy", [a + "q_a_layernorm.weight"])
    kv_norm = ("copy", [a + "kv_a_layernorm.weight"])
    return {
        "self_attention.linear_q_proj.weight": ("copy", [a + "q_proj.weight"]),
        "self_attention.linear_q_down_proj.weight": ("copy", [a + "q_a_proj.weight"]),
        "self_attention.q_layernorm.weight": q_norm,
        "self_attention.linear_q_up_proj.layer_norm_weight": q_norm,
        "self_attention.linear_q_up_proj.weight": ("copy", [a + "q_b_proj.weight"]),
        "self_attention.linear_kv_down_proj.weight": ("copy", [a + "kv_a_proj_with_mqa.weight"]),
        "self_attention.kv_layernorm.weight": kv_norm,
        "self_attention.linear_kv_up_proj.layer_norm_weight": kv_norm,
        "self_attention.linear_kv_up_proj.weight": ("copy", [a + "kv_b_proj.weight"]),
        **shared_expert_names(prefix),
    }


def engine_fused_key(hf: dict, name: str) -> str | None:
    """With q-LoRA, SGLang loads a layer's ``q_a_proj`` and ``kv_a_proj_with_mqa`` (weights,
    and FP8 scales) as one fused tensor, and only when both arrive in the same update call
    (``deepseek_weight_loader.py``, ``fuse_qkv_a_proj``): one key for both, so a weight sync
    keeps them in one bucket."""
    if hf.get("q_lora_rank") is None:
        return None
    for part in ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa."):
        if part in name:
            return name.split(part)[0] + "self_attn.fused_qkv_a_proj_with_mqa"
    return None


def fp8_head_dim(hf: dict, heads: int) -> int | None:
    return None   # MLA's projections are not merged into one QKV


def fp8_moe_intermediate(hf: dict) -> int:
    return int(hf.get("moe_intermediate_size") or 0)


def fp8_dense_mlp(hf: dict, experts: int) -> bool:
    return not experts or int(hf.get("first_k_dense_replace") or 0) > 0


def tiny_init_fields(fields: dict, sections: dict) -> dict:
    """The ``model.init`` fields under DeepSeek-V3's config.json names, with its section
    ``model.init.deepseek`` (``sections``: the families' sections by name)."""
    extra = dict(sections["deepseek"])
    extra.pop("expert_bias_std")
    for key in ("num_key_value_heads", "head_dim", "decoder_sparse_step"):
        fields.pop(key)
    fields.update(extra, n_routed_experts=fields.pop("num_experts"))
    return fields


def check_tiny_init(init) -> None:
    """model.init.deepseek: a DeepSeek-V3 shape both transformers and megatron-core build."""
    if init.deepseek.qk_rope_head_dim % 2:
        raise ConfigError(f"model.init.deepseek.qk_rope_head_dim: must be even, got "
                          f"{init.deepseek.qk_rope_head_dim}")
    check_tiny_router(init)


def tiny_hf_config(transformers, common: dict, fields: dict, init):
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    return transformers.DeepseekV3Config(
        **common, num_key_value_heads=init.num_attention_heads, num_nextn_predict_layers=0,
        topk_method="noaux_tc", rope_interleave=True, **fields)
