"""MiniMax-M2 (MiniMax-M2, M2.1): grouped-query attention without biases, a q/k RMSNorm over
all heads of the projection at once (``qk_norm_type: per_layer``; megatron-core's
``qk_layernorm`` normalises each head alone, so the trainer swaps in
:mod:`moe_rl.trainer.full_width_qk_norm`), rotary embedding on the first ``rotary_dim`` of each
head (the release's legacy field; ``partial_rotary_factor`` in transformers' layout), and
DeepSeek-V3's sigmoid router with its expert bias (``block_sparse_moe.e_score_correction_bias``)
without groups, shared experts or scaling; every layer MoE, the experts under
``block_sparse_moe`` as Mixtral's (w1 gate, w3 up, w2 down). ``moe-rl init-model`` builds a
tiny one (its rotary fraction from ``model.init.glm``, its expert bias from
``model.init.deepseek``)."""
from __future__ import annotations

from moe_rl.errors import ConfigError
from moe_rl.families.names import gated_mlp_expert_names
from moe_rl.families.rope import check_tiny_partial_rotary, gpt_rotary
from moe_rl.families.sigmoid_router import sigmoid_router_settings

MODEL_TYPE = "minimax_m2"
QK_NORM_ACROSS_HEADS = True
TINY = True
HF_ROUTER = "block_sparse_moe.gate"


def check_config(cfg, hf: dict) -> None:
    """Refused when the configuration loads: tensor parallelism (the q/k norm spans every
    head, which tensor parallelism splits across ranks)."""
    if cfg.trainer.parallel.tensor > 1:
        raise ConfigError("trainer.parallel.tensor: > 1 is not supported for MiniMax-M2 models "
                          "yet (its q/k RMSNorm spans all heads, which tensor parallelism "
                          "splits); use expert and data parallelism")


def megatron_settings(spec, sizes, bias_update_rate: float) -> dict:
    """TransformerConfig settings of this family: the q/k norm (full width: see the module
    docstring) and DeepSeek-V3's router without groups; what another MiniMax variant would
    change is refused naming the field."""
    hf = spec.hf_config
    refuse = {
        "qk_norm_type": (hf.get("qk_norm_type", "per_layer") != "per_layer",
                         "only the q/k norm over all heads ('per_layer') is built"),
        "use_qk_norm": (hf.get("use_qk_norm", True) is not True, "the q/k norm is built"),
        "use_routing_bias": (hf.get("use_routing_bias", True) is not True,
                             "the router's expert bias is built"),
        "shared_intermediate_size": (int(hf.get("shared_intermediate_size") or 0) > 0,
                                     "no shared expert is built"),
        "attention_bias": (bool(hf.get("attention_bias")), "attention without biases is built"),
    }
    for key, (bad, why) in refuse.items():
        if bad:
            raise ValueError(f"{key}: {hf.get(key)!r} is not supported for MiniMax-M2: {why}")
    if sizes.tensor > 1:
        raise ValueError("trainer.parallel.tensor: > 1 is not supported for MiniMax-M2 models "
                         "yet (its q/k RMSNorm spans all heads); use expert and data "
                         "parallelism")
    ffn = int(hf["intermediate_size"])
    return dict(ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, moe_router_pre_softmax=False,
                qk_layernorm=True,
                **sigmoid_router_settings(spec, bias_update_rate, "MiniMax-M2"))


def rotary(hf: dict) -> dict:
    """Rotary on each head's first ``rotary_dim`` dimensions (the release's field) or its
    ``partial_rotary_factor`` (transformers' layout)."""
    out = gpt_rotary(hf)
    if hf.get("rotary_dim"):
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
        out["rotary_percent"] = int(hf["rotary_dim"]) / head_dim
    return out


def hf_attention_names(prefix: str) -> dict:
    """The router's expert bias lives beside the router, on the MoE block."""
    return {"mlp.router.expert_bias": ("copy", [prefix + "block_sparse_moe."
                                                "e_score_correction_bias"])}


def hf_expert_names(prefix: str) -> dict:
    return gated_mlp_expert_names(prefix, "block_sparse_moe", "w1", "w3", "w2")


def tiny_init_fields(fields: dict, sections: dict) -> dict:
    """The ``model.init`` fields under MiniMax-M2's config.json names: the expert width is its
    ``intermediate_size``, the rotary fraction ``model.init.glm``'s."""
    for key in ("decoder_sparse_step", "norm_topk_prob", "intermediate_size"):
        fields.pop(key)
    fields.update(intermediate_size=fields.pop("moe_intermediate_size"),
                  num_local_experts=fields.pop("num_experts"),
                  partial_rotary_factor=sections["glm"]["partial_rotary_factor"])
    return fields


def check_tiny_init(init) -> None:
    """A MiniMax-M2 shape both transformers and megatron-core build."""
    if init.num_attention_heads % init.num_key_value_heads:
        raise ConfigError("model.init.num_key_value_heads: must divide model.init."
                          f"num_attention_heads ({init.num_attention_heads})")
    check_tiny_partial_rotary(init)


def tiny_hf_config(transformers, common: dict, fields: dict, init):
    """transformers' config, with the release's own fields beside (SGLang's minimax_m2.py reads
    them, and without them serves another model: no q/k norm, no expert bias, full rotary)."""
    factor = fields.pop("partial_rotary_factor")
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta"),
                                 "partial_rotary_factor": factor}
    return transformers.MiniMaxM2Config(
        **common, **fields, **RELEASE_FIELDS, rotary_dim=int(fields["head_dim"] * factor))


# what the released config.json says about the pieces this module builds
RELEASE_FIELDS = {"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                  "qk_norm_type": "per_layer"}
