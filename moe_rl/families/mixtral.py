"""Mixtral: softmax over all experts, top-k, renormalised; every layer MoE; no q/k norm; the
experts under ``block_sparse_moe`` (w1 gate, w3 up, w2 down)."""
from __future__ import annotations

from moe_rl.families.names import gated_mlp_expert_names
from moe_rl.families.rope import gpt_rotary

MODEL_TYPE = "mixtral"
HF_ROUTER = "block_sparse_moe.gate"


def megatron_settings(spec, sizes, bias_update_rate: float) -> dict:
    ffn = int(spec.hf_config["intermediate_size"])
    return dict(ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, moe_router_pre_softmax=False,
                qk_layernorm=False)


def rotary(hf: dict) -> dict:
    return gpt_rotary(hf)


def hf_expert_names(prefix: str) -> dict:
    return gated_mlp_expert_names(prefix, "block_sparse_moe", "w1", "w3", "w2")


def fp8_head_dim(hf: dict, heads: int) -> int | None:
    return int(hf["hidden_size"] // heads)   # SGLang's rule for Mixtral
