"""Build a megatron-core GPTModel with MoE layers from a Hugging Face config (Qwen3-MoE, Mixtral).

CPU: local layer spec, allgather dispatcher, dropout 0. GPU: Transformer Engine spec when TE is
importable (local otherwise), alltoall dispatcher. Routing replay is always compiled in
(``moe_enable_routing_replay``); whether it acts is decided per forward by the replay controller.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_rl.moe_shape import MoEShape
from moe_rl.trainer.cpu_compat import apply_cpu_shims, check_cpu_settings, cuda_absent
from moe_rl.trainer.parallel import ParallelSizes

SUPPORTED = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the trainer needs to know about a built model."""
    arch: str
    hf_config: dict
    facts: MoEShape
    vocab_size: int
    hidden_size: int
    num_layers: int
    tie_word_embeddings: bool


def load_hf_config(path_or_dict) -> dict:
    """A HF ``config.json`` as a dict, from a model directory, a file or a dict/PretrainedConfig."""
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    if hasattr(path_or_dict, "to_dict"):
        return path_or_dict.to_dict()
    path = os.path.join(path_or_dict, "config.json") if os.path.isdir(path_or_dict) \
        else path_or_dict
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def model_spec(hf: dict) -> ModelSpec:
    """Check the architecture and collect its facts."""
    arch = hf.get("model_type")
    if arch not in SUPPORTED:
        raise ValueError(f"model_type: {arch!r} is not supported; supported: {SUPPORTED}")
    facts = MoEShape.from_hf(hf)
    return ModelSpec(arch, hf, facts, int(hf["vocab_size"]), int(hf["hidden_size"]),
                     int(hf["num_hidden_layers"]), bool(hf.get("tie_word_embeddings", False)))


def rope_settings(hf: dict) -> tuple[float, float]:
    """(rotary base theta, rotary fraction) from either transformers layout: >= 5 writes
    ``rope_parameters: {rope_type, rope_theta, ...}``, older ones a top-level ``rope_theta`` and
    ``rope_scaling``. Only the default rotary type is built; a scaled one (linear, dynamic, YaRN,
    llama3, ...) is refused naming the field, since a silently unscaled rotary is another model."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"rope_parameters: expected a mapping, got {params!r}")
    params = dict(params or {})
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling: expected a mapping or null, got {scaling!r}")
    for field, table in (("rope_parameters", params), ("rope_scaling", scaling or {})):
        kind = table.get("rope_type", table.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"{field}.rope_type: {kind!r} rotary scaling is not supported by the "
                             f"trainer's model builder (only 'default'); the engine would run a "
                             f"different position encoding")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return float(theta), float(fraction)


def transformer_config(spec: ModelSpec, *, sizes: ParallelSizes = ParallelSizes(),
                       dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                       recompute: bool = False, dispatcher: str | None = None):
    """megatron-core TransformerConfig equivalent to the HF config."""
    from megatron.core.transformer import TransformerConfig
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
    )
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    return TransformerConfig(**kwargs)


def layer_spec(config):
    """Per-layer decoder block spec (dense and MoE layers as ``moe_layer_freq`` says): Transformer
    Engine modules when TE is importable and CUDA present, local modules otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    use_te = not cuda_absent() and importlib.util.find_spec("transformer_engine") is not None
    return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                            normalization="RMSNorm")


def uses_te_spec(model) -> bool:
    """Whether the built model uses Transformer Engine modules (fused layer-norm weights)."""
    return any("layer_norm_weight" in n for n, _ in model.named_parameters())


def build_model(hf_config, *, sizes: ParallelSizes = ParallelSizes(),
                dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                recompute: bool = False, pre_process: bool = True, post_process: bool = True):
    """Build the megatron GPTModel for ``hf_config`` (needs the parallel state initialised).

    Clears megatron's global RouterReplay registry first, so the replay controller of this
    model sees exactly this model's routers. Returns (model, ModelSpec).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay
    apply_cpu_shims()
    spec = model_spec(load_hf_config(hf_config))
    config = transformer_config(spec, sizes=sizes, dtype=dtype,
                                sequence_parallel=sequence_parallel, recompute=recompute)
    RouterReplay.clear_global_router_replay_instances()
    hf = spec.hf_config
    theta, fraction = rope_settings(hf)
    if theta != int(theta):
        raise ValueError(f"rope_theta: megatron-core takes an integer rotary base, got {theta}")
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(config),
                     vocab_size=spec.vocab_size,
                     max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
                     pre_process=pre_process, post_process=post_process,
                     share_embeddings_and_output_weights=spec.tie_word_embeddings,
                     position_embedding_type="rope", rotary_base=int(theta),
                     rotary_percent=fraction)
    if not cuda_absent():
        model = model.cuda()
    return model, spec
