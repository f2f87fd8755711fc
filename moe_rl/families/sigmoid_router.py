"""The DeepSeek-V3 router, which other families share (GLM-4.5, MiniMax-M2): sigmoid scores, an
expert bias (``e_score_correction_bias``) that steers the top-k choice only, group-limited top-k,
the gates renormalised and scaled by ``routed_scaling_factor``, shared experts beside the routed
ones."""
from __future__ import annotations

from moe_rl.errors import ConfigError

ROUTER_INIT_FIELDS = ("n_group", "topk_group", "n_shared_experts", "first_k_dense_replace",
                      "routed_scaling_factor")   # model.init.deepseek's, as config.json names them


def sigmoid_router_settings(spec, bias_update_rate: float, name: str) -> dict:
    """megatron-core's router settings for the HF config of ``spec`` (family ``name``, for the
    messages); what megatron-core cannot compute the same way is refused naming the field."""
    hf = spec.hf_config
    refuse = {
        "scoring_func": (hf.get("scoring_func", "sigmoid") != "sigmoid",
                         "only the sigmoid router is built"),
        "topk_method": (hf.get("topk_method", "noaux_tc") != "noaux_tc",
                        "only 'noaux_tc' (biased, group-limited) selection is built"),
        "norm_topk_prob": (not hf.get("norm_topk_prob", True) and spec.moe_shape.topk > 1,
                           "megatron-core always renormalises the sigmoid top-k gates"),
        "hidden_act": (hf.get("hidden_act", "silu") != "silu", "only SiLU experts are built"),
    }
    for key, (bad, why) in refuse.items():
        if bad:
            raise ValueError(f"{key}: {hf.get(key)!r} is not supported for {name}: {why}")
    n_exp, topk = spec.moe_shape.num_experts, spec.moe_shape.topk
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if groups > 1 and n_exp % groups:
        raise ValueError(f"n_group: {groups} does not divide n_routed_experts {n_exp}")
    limited = 1 < groups and group_topk < groups
    if limited and (topk % group_topk or topk // group_topk != 2 or n_exp // groups < 2):
        # transformers ranks a group by its top-2 scores, megatron-core by its top-(k/groups)
        raise ValueError(f"topk_group: group-limited routing needs num_experts_per_tok / "
                         f"topk_group == 2 (both rank a group by its two best experts); got "
                         f"{topk} / {group_topk}")
    shared = int(hf.get("n_shared_experts") or 0)
    moe_ffn = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    return dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=float(bias_update_rate),
        moe_router_num_groups=groups if limited else None,
        moe_router_group_topk=group_topk if limited else None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=moe_ffn * shared if shared else None)


def shared_expert_names(prefix: str) -> dict:
    """The shared experts' rows of the megatron -> HF name table (``prefix``: the layer's
    ``model.layers.{i}.``)."""
    return {
        "mlp.shared_experts.linear_fc1.weight":
            ("cat", [prefix + "mlp.shared_experts.gate_proj.weight",
                     prefix + "mlp.shared_experts.up_proj.weight"]),
        "mlp.shared_experts.linear_fc2.weight":
            ("copy", [prefix + "mlp.shared_experts.down_proj.weight"]),
    }


def check_tiny_router(init) -> None:
    """model.init.deepseek's router fields: a group-limited router and leading dense layers that
    both transformers and megatron-core build."""
    d = init.deepseek
    if init.num_experts % d.n_group:
        raise ConfigError(f"model.init.deepseek.n_group: {d.n_group} must divide "
                          f"model.init.num_experts ({init.num_experts})")
    if d.topk_group > d.n_group:
        raise ConfigError(f"model.init.deepseek.topk_group: {d.topk_group} exceeds n_group "
                          f"({d.n_group})")
    if d.topk_group < d.n_group and init.num_experts_per_tok != 2 * d.topk_group:
        raise ConfigError(f"model.init.deepseek.topk_group: group-limited routing needs "
                          f"num_experts_per_tok = 2 x topk_group (both transformers and "
                          f"megatron-core rank a group by its best experts), got "
                          f"{init.num_experts_per_tok} and {d.topk_group}")
    if d.first_k_dense_replace >= init.num_hidden_layers:
        raise ConfigError(f"model.init.deepseek.first_k_dense_replace: {d.first_k_dense_replace} "
                          f"leaves no MoE layer of {init.num_hidden_layers}")
