"""Build a megatron-core GPTModel with MoE layers from a Hugging Face config (Qwen3-MoE, Mixtral,
DeepSeek-V3: Multi-head Latent Attention, sigmoid router with expert bias, group-limited top-k,
shared experts, leading dense layers).

CPU: local layer spec (MLA's core attention from :mod:`moe_rl.trainer.local_mla`), allgather
dispatcher, dropout 0. GPU: Transformer Engine spec when TE is
importable (local otherwise), alltoall dispatcher. Routing replay is always compiled in
(``moe_enable_routing_replay``); whether it acts is decided per forward by the replay controller.
"""
from __future__ import annotations

import importlib.util
import json
import os

import torch
import torch.nn.functional as F

from moe_rl.config.checks import CP_NEEDS_TE
from moe_rl.moe_shape import ModelSpec, model_spec
from moe_rl.trainer.cpu_compat import apply_cpu_shims, check_cpu_settings, cuda_absent
from moe_rl.trainer.parallel import ParallelSizes



def load_hf_config(path_or_dict) -> dict:
    """A HF ``config.json`` as a dict, from a model directory, a file or a dict/PretrainedConfig."""
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    if hasattr(path_or_dict, "to_dict"):
        return path_or_dict.to_dict()
    path = (os.path.join(path_or_dict, "config.json") if os.path.isdir(path_or_dict)
        else path_or_dict)
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _rope_table(hf: dict) -> tuple[dict, dict]:
    """(rope_parameters, rope_scaling) of either transformers layout, checked to be mappings."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"rope_parameters: expected a mapping, got {params!r}")
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling: expected a mapping or null, got {scaling!r}")
    return dict(params or {}), dict(scaling or {})


def rope_settings(hf: dict) -> tuple[float, float]:
    """(rotary base theta, rotary fraction) from either transformers layout: >= 5 writes
    ``rope_parameters: {rope_type, rope_theta, ...}``, older ones a top-level ``rope_theta`` and
    ``rope_scaling``. Only the default rotary type is built; a scaled one (linear, dynamic, YaRN,
    llama3, ...) is refused naming the field, since a silently unscaled rotary is another model."""
    params, scaling = _rope_table(hf)
    for field, table in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = table.get("rope_type", table.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"{field}.rope_type: {kind!r} rotary scaling is not supported by the "
                             f"trainer's model builder (only 'default'); the engine would run a "
                             f"different position encoding")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return float(theta), float(fraction)


def mla_rope_settings(hf: dict) -> dict:
    """MLATransformerConfig rotary settings of a DeepSeek-V3 config: default RoPE or YaRN (factor,
    original context, beta fast/slow, mscale, mscale_all_dim); other scalings are refused."""
    params, scaling = _rope_table(hf)
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


def _deepseek_settings(spec: ModelSpec, sizes: ParallelSizes, bias_update_rate: float) -> dict:
    """The MLA and router settings of a DeepSeek-V3 config; what megatron-core cannot compute
    the same way is refused naming the field."""
    hf = spec.hf_config
    refuse = {
        "attention_bias": (bool(hf.get("attention_bias")), "attention biases are not built"),
        "rope_interleave": (hf.get("rope_interleave", True) is False,
                            "megatron-core's MLA rotates interleaved pairs only"),
        "scoring_func": (hf.get("scoring_func", "sigmoid") != "sigmoid",
                         "only the sigmoid router is built"),
        "topk_method": (hf.get("topk_method", "noaux_tc") != "noaux_tc",
                        "only 'noaux_tc' (biased, group-limited) selection is built"),
        "norm_topk_prob": (not hf.get("norm_topk_prob", True) and spec.facts.topk > 1,
                           "megatron-core always renormalises the sigmoid top-k gates"),
        "hidden_act": (hf.get("hidden_act", "silu") != "silu", "only SiLU experts are built"),
    }
    for key, (bad, why) in refuse.items():
        if bad:
            raise ValueError(f"{key}: {hf.get(key)!r} is not supported for DeepSeek-V3: {why}")
    if sizes.tensor > 1:
        raise ValueError("trainer.tensor_parallel: > 1 is not supported for DeepSeek-V3 (MLA) "
                         "models yet; use expert and data parallelism")
    n_exp, topk = spec.facts.num_experts, spec.facts.topk
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
    moe_ffn = int(hf["moe_intermediate_size"])
    return dict(
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=int(hf["kv_lora_rank"]), qk_head_dim=int(hf["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
        kv_channels=int(hf["v_head_dim"]), **mla_rope_settings(hf),
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=float(bias_update_rate),
        moe_router_num_groups=groups if limited else None,
        moe_router_group_topk=group_topk if limited else None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=moe_ffn * shared if shared else None)


def transformer_config(spec: ModelSpec, *, sizes: ParallelSizes = ParallelSizes(),
                       dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                       recompute: bool = False, dispatcher: str | None = None,
                       expert_bias_update_rate: float = 0.0):
    """megatron-core TransformerConfig (MLATransformerConfig for DeepSeek-V3) equivalent to the
    HF config. ``expert_bias_update_rate``: megatron's aux-loss-free update of the DeepSeek-V3
    expert bias per optimizer step (0 keeps the bias frozen)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    hf = spec.hf_config
    cpu = cuda_absent()
    dispatcher = dispatcher or ("allgather" if cpu else "alltoall")
    check_cpu_settings(tensor_parallel=sizes.tensor, pipeline_parallel=sizes.pipeline,
                       context_parallel=sizes.context, sequence_parallel=sequence_parallel,
                       dispatcher=dispatcher)
    moe_layers = set(spec.facts.moe_layers)
    n_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or spec.hidden_size // n_heads)
    if spec.arch == "qwen3_moe":
        moe_ffn = int(hf["moe_intermediate_size"])
        dense_ffn = int(hf.get("intermediate_size") or moe_ffn)
        pre_softmax = not bool(hf.get("norm_topk_prob", True))
        qk_norm = True
        if hf.get("attention_bias"):
            raise ValueError("attention_bias: Qwen3-MoE with attention biases is not supported")
    elif spec.arch == "deepseek_v3":
        moe_ffn = int(hf["moe_intermediate_size"])
        dense_ffn = int(hf.get("intermediate_size") or moe_ffn)
        pre_softmax = False
        qk_norm = True   # MLA's q_a_layernorm / kv_a_layernorm
    else:  # mixtral: softmax over all experts, top-k, renormalised
        moe_ffn = dense_ffn = int(hf["intermediate_size"])
        pre_softmax = False
        qk_norm = False
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=n_heads,
        num_query_groups=int(hf.get("num_key_value_heads") or n_heads), kv_channels=head_dim,
        ffn_hidden_size=dense_ffn, moe_ffn_hidden_size=moe_ffn,
        num_moe_experts=spec.facts.num_experts, moe_router_topk=spec.facts.topk,
        moe_layer_freq=[1 if i in moe_layers else 0 for i in range(spec.num_layers)],
        moe_router_pre_softmax=pre_softmax, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
        moe_enable_routing_replay=True, moe_router_fusion=False,
        normalization="RMSNorm", layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        qk_layernorm=qk_norm, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=sizes.tensor, pipeline_model_parallel_size=sizes.pipeline,
        context_parallel_size=sizes.context, expert_model_parallel_size=sizes.expert,
        sequence_parallel=sequence_parallel, use_cpu_initialization=cpu,
        apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        # the loss is already normalised by global token/sequence counts: data-parallel
        # gradients must be summed, not averaged (megatron's DDP sums under this flag)
        calculate_per_token_loss=True,
        # megatron's own default ("full") is deprecated in its favour: the whole layer, no graph
        cuda_graph_scope=[],
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    if spec.arch == "deepseek_v3":
        kwargs.update(_deepseek_settings(spec, sizes, expert_bias_update_rate))
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def te_available() -> bool:
    """Whether models are built on Transformer Engine's spec: TE importable and CUDA present."""
    return not cuda_absent() and importlib.util.find_spec("transformer_engine") is not None


def layer_spec(config):
    """Per-layer decoder block spec (dense and MoE layers as ``moe_layer_freq`` says): Transformer
    Engine modules when TE is importable and CUDA present, local modules otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    use_te = te_available()
    block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                             normalization="RMSNorm")
    if not use_te:
        use_local_attention(block, config.multi_latent_attention)
    return block


def use_local_attention(block, mla: bool) -> None:
    """A local-spec decoder block ``block``: core attention that also takes packed (THD)
    rows (:mod:`moe_rl.trainer.local_attention`); with ``mla`` MLA's (:mod:`moe_rl.trainer.
    local_mla`) (in place)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from moe_rl.trainer.local_attention import PackedLocalAttention
    if mla:
        from moe_rl.trainer.local_mla import use_local_mla
        use_local_mla(block)
        return
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = PackedLocalAttention


def uses_te_spec(model) -> bool:
    """Whether the built model uses Transformer Engine modules (fused layer-norm weights)."""
    return any("layer_norm_weight" in n for n, _ in model.named_parameters())


def build_model(hf_config, *, sizes: ParallelSizes = ParallelSizes(),
                dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                recompute: bool = False, pre_process: bool = True, post_process: bool = True,
                expert_bias_update_rate: float = 0.0):
    """Build the megatron GPTModel for ``hf_config`` (needs the parallel state initialised).

    Clears megatron's global RouterReplay registry first, so the replay controller of this
    model sees exactly this model's routers. Returns (model, ModelSpec).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay
    if sizes.context > 1 and not te_available():
        raise ValueError(CP_NEEDS_TE)
    apply_cpu_shims()
    spec = model_spec(load_hf_config(hf_config))
    config = transformer_config(spec, sizes=sizes, dtype=dtype,
                                sequence_parallel=sequence_parallel, recompute=recompute,
                                expert_bias_update_rate=expert_bias_update_rate)
    RouterReplay.clear_global_router_replay_instances()
    hf = spec.hf_config
    if spec.arch == "deepseek_v3":   # MLA applies its own rotary embedding
        rotary = dict(position_embedding_type="none")
    else:
        theta, fraction = rope_settings(hf)
        if theta != int(theta):
            raise ValueError(f"rope_theta: megatron-core takes an integer rotary base, got {theta}")
        rotary = dict(position_embedding_type="rope", rotary_base=int(theta),
                      rotary_percent=fraction)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(config),
                     vocab_size=spec.vocab_size,
                     max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
                     pre_process=pre_process, post_process=post_process,
                     share_embeddings_and_output_weights=spec.tie_word_embeddings, **rotary)
    for p in model.parameters():   # every weight in ``dtype``, the norms' too (megatron-core's
        if p.is_floating_point() and p.dtype != dtype:   # Float16Module; SGLang serves them so)
            p.data = p.data.to(dtype)
    if not cuda_absent():
        model = model.cuda()
    return model, spec
