"""The settings of ``moe-rl init-model`` (``model.init``): the tiny model's shape, its rules, and
the HF ``config.json`` fields it becomes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moe_rl.config.fields import _f, _rng, _sub, as_dict
from moe_rl.families import TINY_FAMILIES, family



@dataclass
class DeepseekInitConfig:
    """DeepSeek-V3's shape of the tiny model (``model.init.architecture: deepseek_v3``): MLA
    and the router; GLM-4.5 (``glm4_moe``) shares the router fields (n_group on)."""
    q_lora_rank: int | None = _f(32, "query LoRA rank of MLA (null = full query projection)",
                                 **_rng(1))
    kv_lora_rank: int = _f(32, "compressed key/value (latent) size of MLA", **_rng(1))
    qk_nope_head_dim: int = _f(16, "per-head query/key size without rotary", **_rng(1))
    qk_rope_head_dim: int = _f(8, "per-head rotary query/key size (even)", **_rng(2))
    v_head_dim: int = _f(16, "per-head value size", **_rng(1))
    n_group: int = _f(4, "expert groups of the group-limited router", **_rng(1))
    topk_group: int = _f(2, "groups a token may use (num_experts_per_tok / topk_group must be 2 "
                         "when < n_group)", **_rng(1))
    n_shared_experts: int = _f(1, "shared (always-on, never routed) experts per MoE layer",
                               **_rng(0))
    first_k_dense_replace: int = _f(1, "leading dense layers", **_rng(0))
    routed_scaling_factor: float = _f(2.5, "scale of the routed experts' gate weights",
                                      **_rng(0, lo_open=True))
    expert_bias_std: float = _f(0.01, "std of the random initial expert bias "
                                "(e_score_correction_bias)", **_rng(0))


@dataclass
class GlmInitConfig:
    """GLM-4.5's shape of the tiny model (``model.init.architecture: glm4_moe``; its rotary
    fraction is MiniMax-M2's too); its router and leading dense layers come from
    ``model.init.deepseek``'s n_group ... expert_bias_std."""
    partial_rotary_factor: float = _f(0.5, "fraction of each head's dimension the rotary "
                                      "embedding turns (head_dim x it must be even)",
                                      **_rng(0, 1, lo_open=True))
    attention_bias: bool = _f(True, "biases on the q, k and v projections")
    use_qk_norm: bool = _f(True, "RMSNorm on each head's query and key")


@dataclass
class GptOssInitConfig:
    """gpt-oss-only shape of the tiny model (``model.init.architecture: gpt_oss``): its layers
    alternate sliding-window and full attention (the first a window layer), its expert width
    is model.init.moe_intermediate_size."""
    sliding_window: int = _f(8, "keys a window layer's query sees (itself included)", **_rng(1))
    swiglu_limit: float = _f(7.0, "clamp of the experts' SwiGLU (gate above, up both sides)",
                             **_rng(0, lo_open=True))
    yarn_original_max_position_embeddings: int = _f(
        16, "the context YaRN stretches to model.init.max_position_embeddings (its factor: "
        "their ratio, as gpt-oss's 4096 -> 131072)", **_rng(1))


@dataclass
class ModelInitConfig:
    """Shape of the tiny model written by ``moe-rl init-model`` (Qwen3-MoE, DeepSeek-V3,
    GLM-4.5, gpt-oss or MiniMax-M2)."""
    architecture: Literal[TINY_FAMILIES] = _f(
        "qwen3_moe", "qwen3_moe, deepseek_v3 (MLA, sigmoid router with expert bias, "
        "group-limited top-k, shared experts; shaped further by model.init.deepseek) or "
        "glm4_moe (grouped-query attention with biases, q/k norm and partial rotary: "
        "model.init.glm; DeepSeek-V3's router: model.init.deepseek's router fields) or "
        "gpt_oss (attention sinks, sliding windows, YaRN, biases, clamped SwiGLU: "
        "model.init.gpt_oss) or minimax_m2 (q/k norm over all heads, partial rotary: "
        "model.init.glm.partial_rotary_factor; the sigmoid router with expert bias, "
        "model.init.deepseek.expert_bias_std)")
    hidden_size: int = _f(64, "hidden size", **_rng(1))
    num_hidden_layers: int = _f(2, "decoder layers", **_rng(1))
    num_attention_heads: int = _f(4, "attention heads", **_rng(1))
    num_key_value_heads: int = _f(2, "key/value heads (GQA)", **_rng(1))
    head_dim: int = _f(16, "attention head dimension", **_rng(1))
    intermediate_size: int = _f(128, "dense MLP size (dense layers only)", **_rng(1))
    moe_intermediate_size: int = _f(64, "expert MLP size", **_rng(1))
    num_experts: int = _f(8, "routed experts per MoE layer", **_rng(1, 65535))
    num_experts_per_tok: int = _f(2, "router top-k", **_rng(1))
    decoder_sparse_step: int = _f(1, "every n-th layer is MoE", **_rng(1))
    norm_topk_prob: bool = _f(True, "renormalise the top-k gate probabilities")
    max_position_embeddings: int = _f(256, "maximum sequence length", **_rng(1))
    rope_theta: float = _f(10000.0, "rotary base", **_rng(0, lo_open=True))
    rms_norm_eps: float = _f(1e-6, "RMSNorm epsilon", **_rng(0, lo_open=True))
    tie_word_embeddings: bool = _f(False, "tie input and output embeddings")
    seed: int = _f(0, "weight initialisation seed")
    deepseek: DeepseekInitConfig = _sub(DeepseekInitConfig, "DeepSeek-V3's shape "
                                        "(num_key_value_heads, head_dim, decoder_sparse_step "
                                        "do not apply to it); its router fields shape GLM-4.5")
    glm: GlmInitConfig = _sub(GlmInitConfig, "GLM-4.5's shape (decoder_sparse_step does not "
                              "apply to it; MiniMax-M2 takes its partial_rotary_factor)")
    gpt_oss: GptOssInitConfig = _sub(GptOssInitConfig, "gpt-oss-only shape (decoder_sparse_step, "
                                     "norm_topk_prob and intermediate_size do not apply to it)")


def init_hf_fields(init: ModelInitConfig) -> dict:
    """The ``model.init`` shape under the names of the architecture's HF ``config.json``."""
    fields = as_dict(init)
    sections = {k: fields.pop(k) for k in ("deepseek", "glm", "gpt_oss")}
    fields["model_type"] = fields.pop("architecture")
    return family(init.architecture).tiny_init_fields(fields, sections)
