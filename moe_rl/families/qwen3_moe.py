"""Qwen3-MoE (and its Qwen2-MoE layer rules): softmax router over all experts with the top-k
renormalised unless ``norm_topk_prob`` is false, q/k RMSNorm, ``mlp_only_layers`` /
``decoder_sparse_step`` dense layers."""
from __future__ import annotations

from moe_rl.errors import ConfigError
from moe_rl.families.names import gated_mlp_expert_names
from moe_rl.families.rope import gpt_rotary

MODEL_TYPE = "qwen3_moe"
TINY = True
HF_ROUTER = "mlp.gate"


def megatron_settings(spec, sizes, bias_update_rate: float) -> dict:
    """TransformerConfig settings of this family."""
    hf = spec.hf_config
    if hf.get("attention_bias"):
        raise ValueError("attention_bias: Qwen3-MoE with attention biases is not supported")
    moe_ffn = int(hf["moe_intermediate_size"])
    return dict(ffn_hidden_size=int(hf.get("intermediate_size") or moe_ffn),
                moe_ffn_hidden_size=moe_ffn,
                moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", True)),
                qk_layernorm=True)


def rotary(hf: dict) -> dict:
    return gpt_rotary(hf)


def hf_expert_names(prefix: str) -> dict:
    return gated_mlp_expert_names(prefix)


def fp8_dense_mlp(hf: dict, experts: int) -> bool:
    """Whether the model has dense MLP layers (their gate/up partition is checked)."""
    return (not experts or bool(hf.get("mlp_only_layers"))
            or int(hf.get("decoder_sparse_step") or 1) > 1)


def tiny_init_fields(fields: dict, sections: dict) -> dict:
    """The ``model.init`` fields under this family's config.json names (``sections``: the
    other families' sections, unused here)."""
    return fields


def check_tiny_init(init) -> None:
    if init.num_attention_heads % init.num_key_value_heads:
        raise ConfigError("model.init.num_key_value_heads: must divide model.init."
                          f"num_attention_heads ({init.num_attention_heads})")


def tiny_hf_config(transformers, common: dict, fields: dict, init):
    return transformers.Qwen3MoeConfig(**common, mlp_only_layers=[], output_router_logits=False,
                                       router_aux_loss_coef=0.0, **fields)
