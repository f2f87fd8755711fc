"""gpt-oss (gpt-oss-20b, gpt-oss-120b): grouped-query attention with biases on every projection
and a learned sink logit per head (megatron-core's ``softmax_type: learnable``), sliding-window
layers between full ones (``layer_types``), YaRN rotary, a router with a bias whose softmax runs
over the top-k logits, and experts with biases and a clamped SwiGLU
(``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``; megatron-core's
``glu_linear_offset`` and ``activation_func_clamp_value``). Every layer is MoE. The checkpoint
stacks a layer's experts in one tensor each (``mlp.experts.gate_up_proj`` [E, hidden, 2 x
inter] with gate and up columns interleaved, ``down_proj`` [E, inter, hidden], their biases);
the name table reads and writes one expert's rows of them (:mod:`moe_rl.weights.hf`). The
released MXFP4 checkpoints are read dequantised (:mod:`moe_rl.weights.mxfp4_checkpoint`).
``moe-rl init-model`` builds a tiny one (``model.init.gpt_oss``)."""
from __future__ import annotations

import functools

from moe_rl.errors import ConfigError
from moe_rl.families.rope import rope_table

MODEL_TYPE = "gpt_oss"
ATTENTION_SINKS = True
TINY = True
HF_ROUTER = "mlp.router"


def check_config(cfg, hf: dict) -> None:
    """What a gpt-oss run cannot do, refused when its configuration is loaded (before any
    engine starts): tensor parallelism (also refused where the model is built,
    :func:`megatron_settings`), FP8 rollout weights (moe_rl's FP8 checkpoint takes 2-D
    weights, the reference engine's FP8 experts [E, out, in] without biases; gpt-oss stacks
    them [E, in, out] with biases). ``hf``: the model's config.json fields (or its
    ``model.init`` shape's)."""
    if cfg.trainer.parallel.tensor > 1:
        raise ConfigError("trainer.parallel.tensor: > 1 is not supported for gpt-oss models yet "
                          "(megatron-core builds expert biases only without expert tensor "
                          "parallelism); use expert and data parallelism")
    if cfg.rollout.quantization == "fp8":
        raise ConfigError("rollout.quantization: fp8 rollout weights are not built for gpt-oss "
                          "(its experts are stacked [E, in, out] with biases, which moe_rl's FP8 "
                          "checkpoint and the reference engine's FP8 experts do not take); use "
                          "none, or mxfp4 on the reference engine")


def sigmoid_gate(x, alpha: float):
    """gpt-oss's gate activation ``x * sigmoid(alpha * x)`` of a tensor ``x`` (megatron's
    quick_gelu at 1.702)."""
    return x * (alpha * x).sigmoid()


def megatron_settings(spec, sizes, bias_update_rate: float) -> dict:
    """TransformerConfig settings of this family: biases everywhere, the sinks, the sliding
    windows, the clamped SwiGLU, the router, YaRN (megatron's GPTModel reads the ``yarn_*``
    settings as attributes its config does not declare: :func:`moe_rl.trainer.model_builder.
    transformer_config` sets them)."""
    hf = spec.hf_config
    refuse = {   # (a quantised checkpoint: refused or read dequantised by model_spec)
        "attention_bias": (hf.get("attention_bias") is False, "gpt-oss is built with biases"),
    }
    for key, (bad, why) in refuse.items():
        if bad:
            raise ValueError(f"{key}: {hf.get(key)!r} is not supported for gpt-oss: {why}")
    if sizes.tensor > 1:
        raise ValueError("trainer.parallel.tensor: > 1 is not supported for gpt-oss models yet "
                         "(megatron-core builds expert biases only without expert tensor "
                         "parallelism); use expert and data parallelism")
    inter = int(hf["intermediate_size"])
    kinds = list(hf.get("layer_types") or [])
    if len(kinds) != spec.num_layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types: expected {spec.num_layers} of 'sliding_attention' / "
                         f"'full_attention', got {kinds!r}")
    window = hf.get("sliding_window")
    sliding = "sliding_attention" in kinds
    if sliding and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"sliding_window: expected a positive integer, got {window!r}")
    return dict(
        ffn_hidden_size=inter, moe_ffn_hidden_size=inter, add_bias_linear=True,
        add_qkv_bias=True, expert_tensor_parallel_size=1, qk_layernorm=False,
        moe_router_score_function="softmax", moe_router_pre_softmax=False,
        # router logits in the model's dtype, as SGLang (TinyGemmLinear in config.dtype) and
        # transformers (F.linear) compute them
        moe_router_dtype=None, softmax_type="learnable",
        # transformers: key j is seen from query i when i - j < sliding_window
        window_size=(window - 1, 0) if sliding else None,
        window_attn_skip_freq=[int(k == "sliding_attention") for k in kinds] if sliding else None,
        activation_func=functools.partial(sigmoid_gate,
                                          alpha=float(hf.get("swiglu_alpha", 1.702))),
        glu_linear_offset=1.0, activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
        **_yarn(hf))


def _yarn(hf: dict) -> dict:
    """megatron's YaRN settings of the rotary table (default RoPE: none)."""
    params, scaling = rope_table(hf)
    table = {**scaling, **params}
    kind = table.get("rope_type", table.get("type", "default"))
    if kind in ("default", None):
        return {}
    if kind != "yarn":
        raise ValueError(f"rope_parameters.rope_type: {kind!r} is not supported for gpt-oss "
                         f"(megatron-core's GPTModel builds 'default' and 'yarn')")
    if table.get("attention_factor") is not None:
        raise ValueError("rope_parameters.attention_factor: an explicit YaRN attention factor "
                         "is not built (megatron-core derives it from factor and mscale)")
    return dict(yarn_rotary_scaling_factor=float(table["factor"]),
                yarn_original_max_position_embeddings=int(
                    table.get("original_max_position_embeddings")
                    or hf["max_position_embeddings"]),
                yarn_beta_fast=float(table.get("beta_fast") or 32.0),
                yarn_beta_slow=float(table.get("beta_slow") or 1.0),
                yarn_mscale=table.get("mscale"), yarn_mscale_all_dim=table.get("mscale_all_dim"),
                yarn_correction_range_round_to_int=bool(table.get("truncate", True)))


def rotary(hf: dict) -> dict:
    params, scaling = rope_table(hf)
    table = {**scaling, **params}
    theta = float(table.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise ValueError(f"rope_theta: megatron-core takes an integer rotary base, got {theta}")
    kind = "yarn" if _yarn(hf) else "rope"
    return dict(position_embedding_type=kind, rotary_base=int(theta), rotary_percent=1.0)


def hf_attention_names(prefix: str) -> dict:
    """Rows of the megatron -> HF name table beyond the shared ones: the attention's biases and
    sinks, the router's bias."""
    a = prefix + "self_attn."
    return {"self_attention.linear_qkv.bias": ("qkv", [a + "q_proj.bias", a + "k_proj.bias",
                                                       a + "v_proj.bias"]),
            "self_attention.linear_proj.bias": ("copy", [a + "o_proj.bias"]),
            "self_attention.core_attention.softmax_offset": ("copy", [a + "sinks"]),
            "mlp.router.bias": ("copy", [prefix + "mlp.router.bias"])}


def hf_expert_names(prefix: str) -> dict:
    """One expert's rows of the name table: each megatron tensor is that expert's row of a
    stacked HF tensor (the ``rows:`` ways of :mod:`moe_rl.weights.hf`)."""
    x = prefix + "mlp.experts."
    return {"linear_fc1.weight": ("rows:gate_up", [x + "gate_up_proj"]),
            "linear_fc1.bias": ("rows:gate_up_bias", [x + "gate_up_proj_bias"]),
            "linear_fc2.weight": ("rows:down", [x + "down_proj"]),
            "linear_fc2.bias": ("rows:copy", [x + "down_proj_bias"])}


def tiny_init_fields(fields: dict, sections: dict) -> dict:
    """The ``model.init`` fields under gpt-oss's config.json names: the expert width is its
    ``intermediate_size``; ``model.init.gpt_oss`` adds the windows, the SwiGLU limit and YaRN's
    original context."""
    for key in ("decoder_sparse_step", "norm_topk_prob", "intermediate_size"):
        fields.pop(key)
    g = sections["gpt_oss"]
    layers = fields["num_hidden_layers"]
    fields.update(intermediate_size=fields.pop("moe_intermediate_size"),
                  num_local_experts=fields.pop("num_experts"),
                  sliding_window=g["sliding_window"], swiglu_limit=g["swiglu_limit"],
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                               for i in range(layers)],
                  yarn_original_max_position_embeddings=g["yarn_original_max_position_embeddings"])
    return fields


def check_tiny_init(init) -> None:
    """model.init.gpt_oss: a shape both transformers and megatron-core build."""
    if init.num_attention_heads % init.num_key_value_heads:
        raise ConfigError("model.init.num_key_value_heads: must divide model.init."
                          f"num_attention_heads ({init.num_attention_heads})")
    g = init.gpt_oss
    if g.yarn_original_max_position_embeddings > init.max_position_embeddings:
        raise ConfigError(f"model.init.gpt_oss.yarn_original_max_position_embeddings: "
                          f"{g.yarn_original_max_position_embeddings} exceeds "
                          f"model.init.max_position_embeddings ({init.max_position_embeddings})")


def tiny_hf_config(transformers, common: dict, fields: dict, init):
    fields["rope_parameters"] = {
        "rope_type": "yarn", "rope_theta": fields.pop("rope_theta"),
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    original = fields.pop("yarn_original_max_position_embeddings")
    fields["rope_parameters"].update(
        original_max_position_embeddings=original,
        factor=fields["max_position_embeddings"] / original)
    return transformers.GptOssConfig(**common, output_router_logits=False,
                                     router_aux_loss_coef=0.0, **fields)
