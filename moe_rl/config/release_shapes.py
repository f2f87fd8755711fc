"""The shapes of the releases moe_rl ships a configuration for (the fields of their published
``config.json`` that shape the parameters), so that ``moe-rl plan`` estimates a shipped config's
memory before the checkpoint is on the node: ``model.path``'s last folder names the release
(``/models/Qwen3-30B-A3B``, ``/models/gpt-oss-20b-bf16``)."""
from __future__ import annotations

import os

QWEN3_30B_A3B = {   # Qwen/Qwen3-30B-A3B's config.json (the keys that shape the parameters)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 128,
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "moe_intermediate_size": 768, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "vocab_size": 151936, "attention_bias": False}

GLM45_AIR = {   # zai-org/GLM-4.5-Air's config.json (the keys that shape the parameters)
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "head_dim": 128, "hidden_size": 4096, "partial_rotary_factor": 0.5,
    "intermediate_size": 10944, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96,
    "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "use_qk_norm": False, "vocab_size": 151552}

GPT_OSS_20B = {   # openai/gpt-oss-20b's config.json in bfloat16 (without quantization_config)
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "tie_word_embeddings": False, "vocab_size": 201088}

MINIMAX_M2 = {   # MiniMaxAI/MiniMax-M2's config.json in bfloat16 (the keys that shape it)
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "head_dim": 128,
    "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608,
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
    "num_key_value_heads": 8, "num_local_experts": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid", "use_routing_bias": True,
    "use_qk_norm": True, "qk_norm_type": "per_layer", "tie_word_embeddings": False,
    "vocab_size": 200064}

RELEASES = {"Qwen3-30B-A3B": QWEN3_30B_A3B, "GLM-4.5-Air": GLM45_AIR, "gpt-oss-20b": GPT_OSS_20B,
            "MiniMax-M2": MINIMAX_M2}
# a copy in another precision keeps the release's shape
COPY_SUFFIXES = ("-bf16", "-bfloat16", "-fp16", "-float16", "-fp32", "-float32")


def release_shape(model_path: str) -> tuple[str, dict] | None:
    """(release name, its config.json fields) when ``model_path``'s last folder names a release
    (case and a precision suffix aside), else None."""
    name = os.path.basename(os.path.normpath(model_path)).lower()
    for suffix in COPY_SUFFIXES:
        name = name.removesuffix(suffix)
    for release, fields in RELEASES.items():
        if release.lower() == name:
            return release, dict(fields)
    return None
