"""Build a megatron-core GPTModel with MoE layers from a Hugging Face config (every family of
:mod:`moe_rl.families`: Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5, gpt-oss).

CPU: local layer spec (MLA's core attention from :mod:`moe_rl.trainer.local_mla`), allgather
dispatcher, dropout 0. GPU: Transformer Engine spec when TE is
importable (local otherwise), alltoall dispatcher. Routing replay is always compiled in
(``moe_enable_routing_replay``); whether it acts is decided per forward by the replay controller.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from importlib.metadata import version

import torch
import torch.nn.functional as F

from moe_rl.config.checks import CP_NEEDS_TE
from moe_rl.families.shape import ModelSpec, model_spec
from moe_rl.trainer.cpu_compat import apply_cpu_shims, check_cpu_settings, cuda_absent
from moe_rl.trainer.expert_path import choose_expert_path
from moe_rl.trainer.parallel import ParallelSizes
from moe_rl.trainer.full_width_qk_norm import use_full_width_qk_norm
from moe_rl.trainer.local_expert_bias import copy_expert_outputs


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
    moe_layers = set(spec.moe_shape.moe_layers)
    n_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or spec.hidden_size // n_heads)
    fam = spec.family
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=n_heads,
        num_query_groups=int(hf.get("num_key_value_heads") or n_heads), kv_channels=head_dim,
        num_moe_experts=spec.moe_shape.num_experts, moe_router_topk=spec.moe_shape.topk,
        moe_layer_freq=[1 if i in moe_layers else 0 for i in range(spec.num_layers)],
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
        moe_enable_routing_replay=True, moe_router_fusion=False,
        normalization="RMSNorm", layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=F.silu,
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
    kwargs.update(fam.megatron_settings(spec, sizes, expert_bias_update_rate))
    cls = MLATransformerConfig if fam.MULTI_LATENT_ATTENTION else TransformerConfig
    # megatron's GPTModel reads its YaRN settings (``yarn_*``) as attributes the config
    # class does not declare (gpt_model.py, position_embedding_type 'yarn')
    declared = {f.name for f in dataclasses.fields(cls)}
    config = cls(**{k: v for k, v in kwargs.items() if k in declared})
    for k, v in kwargs.items():
        if k not in declared:
            if not k.startswith("yarn_"):
                raise TypeError(f"{fam.MODEL_TYPE}: megatron-core has no setting {k!r}")
            setattr(config, k, v)
    return config


def te_available() -> bool:
    """Whether models are built on Transformer Engine's spec: TE importable and CUDA present."""
    return not cuda_absent() and importlib.util.find_spec("transformer_engine") is not None


TE_PERMUTE_FUSION = (2, 1)   # the first Transformer Engine with megatron's fused permute


def te_permute_fusion() -> bool:
    """Whether the installed Transformer Engine has the fused token permutation megatron's
    ``moe_permute_fusion`` needs (TE >= 2.1; ``moe_router_fusion`` stays off: it skips routing
    replay)."""
    te = version("transformer_engine")
    return tuple(int(x) for x in re.findall(r"\d+", te)[:2]) >= TE_PERMUTE_FUSION


def layer_spec(config, sdpa: bool = True) -> tuple[object, tuple[str, str]]:
    """Per-layer decoder block spec (dense and MoE layers as ``moe_layer_freq`` says): Transformer
    Engine modules when TE is importable and CUDA present, local modules otherwise; MLA without
    query LoRA with the checkpoint's query projection (:mod:`moe_rl.trainer.mla_query`). With the
    core attention it uses: (path, why)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from moe_rl.trainer.mla_query import use_hf_query_projection
    use_te = te_available()
    block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                             normalization="RMSNorm")
    attention = ("te", "Transformer Engine's fused attention")
    if not use_te:
        attention = use_local_attention(block, config, sdpa)
    if config.multi_latent_attention and config.q_lora_rank is None:
        use_hf_query_projection(block)
    return block, attention


TE_THD_UNEQUAL_HEAD_DIMS = (2, 20)   # the first Transformer Engine release seen attending packed
                                     # (THD) rows whose query/key and value head sizes differ


def mla_packing_warning(config, packed: bool) -> str | None:
    """What to tell a user who packs sequences (``trainer.pack_sequences``) of an MLA model whose
    query/key and value head sizes differ on Transformer Engine's spec when neither megatron-core
    pads the values itself (from 0.17 on; 0.16.1 lacks it, Megatron-LM PR #3003) nor the
    installed Transformer Engine is a release known to accept the two sizes on packed rows
    (TE's choice of attention backend can be read only on a GPU, so its version is the test).
    None when none of that applies."""
    if not (packed and config.multi_latent_attention and te_available()):
        return None
    qk = config.qk_head_dim + config.qk_pos_emb_head_dim
    if qk == config.v_head_dim:
        return None
    import megatron.core.transformer.multi_latent_attention as mla
    if hasattr(mla, "_prepare_mla_core_attention_value"):   # megatron pads V on packed rows
        return None
    te = version("transformer_engine")
    if tuple(int(x) for x in re.findall(r"\d+", te)[:2]) >= TE_THD_UNEQUAL_HEAD_DIMS:
        return None
    return (f"trainer.pack_sequences: this MLA model's packed rows need attention with query/key "
            f"head size {qk} and value head size {config.v_head_dim}; this megatron-core does "
            f"not pad the values itself and Transformer Engine {te} may choose a backend that "
            f"refuses them (2.20 accepts them). If the first step fails in attention, set "
            f"trainer.pack_sequences=false or install Transformer Engine >= 2.20 or "
            f"megatron-core >= 0.17 (Python 3.12)")


def use_local_attention(block, config, sdpa: bool = True) -> tuple[str, str]:
    """A local-spec decoder block ``block`` of megatron-core ``config``: core attention through
    torch's fused kernel (:mod:`moe_rl.trainer.sdpa_attention`) where it fits (and ``sdpa``;
    False keeps the local kernel, for comparisons), else megatron's
    local kernel that also takes packed (THD) rows (:mod:`moe_rl.trainer.local_attention`;
    MLA's: :mod:`moe_rl.trainer.local_mla`) (in place). Returns (path, why)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from moe_rl.trainer.local_attention import PackedLocalAttention
    from moe_rl.trainer.local_mla import LocalMLACoreAttention, use_local_mla
    from moe_rl.trainer.sdpa_attention import SDPAttention, attention_unsupported
    why = attention_unsupported(config) if sdpa else "sdpa=False, for comparison"
    mla = config.multi_latent_attention
    if mla:
        use_local_mla(block)
    local = LocalMLACoreAttention if mla else PackedLocalAttention
    chosen = SDPAttention if why is None else local
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention in (DotProductAttention, local):
            attention.core_attention = chosen
    if why is None:
        return "sdpa", "torch's scaled_dot_product_attention"
    return "local", f"megatron's unfused kernel ({why})"


def uses_te_spec(model) -> bool:
    """Whether the built model uses Transformer Engine modules (fused layer-norm weights)."""
    return any("layer_norm_weight" in n for n, _ in model.named_parameters())


NO_EXPERT_SLOT = "this megatron-core's layer spec has no SequentialMLP slot to fill"


def _is_moe(mlp) -> bool:
    """Whether a layer spec's MLP (a ``ModuleSpec`` or a ``functools.partial``) is an MoE
    layer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    return getattr(mlp, "module", getattr(mlp, "func", None)) is MoELayer


def build_model(hf_config, *, sizes: ParallelSizes = ParallelSizes(),
                dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                recompute: bool = False, pre_process: bool = True, post_process: bool = True,
                expert_bias_update_rate: float = 0.0, experts: str = "auto",
                sort_dispatch: bool = True, sdpa: bool = True):
    """Build the megatron GPTModel for ``hf_config`` (needs the parallel state initialised),
    its experts on the path ``experts`` chooses (``trainer.experts``: :mod:`.expert_path`),
    its tokens dispatched by sort where every expert is local (``sort_dispatch``:
    :mod:`.sort_dispatcher`; False keeps megatron's dispatcher, for comparisons), its attention
    through torch's SDPA where it fits (``sdpa``; False: megatron's local kernel); the model's
    ``expert_path``, ``attention_path`` and ``dispatch_path`` say which ran and why.

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
    expert_path = choose_expert_path(experts, config.hidden_size, config.moe_ffn_hidden_size
                                     // config.expert_tensor_parallel_size, dtype,
                                     te_available())
    if expert_path[0] == "te_grouped":   # TE's spec then builds TEGroupedMLP
        config = dataclasses.replace(config, moe_grouped_gemm=True,
                                     moe_permute_fusion=te_permute_fusion())
    block, attention_path = layer_spec(config, sdpa)
    if expert_path[0] == "grouped":
        from moe_rl.trainer.grouped_experts import use_grouped_experts
        if not use_grouped_experts(block) and any(
                _is_moe(layer.submodules.mlp) for layer in block.layer_specs):
            if experts == "grouped":
                raise ValueError(f"trainer.experts: grouped cannot run here: {NO_EXPERT_SLOT}")
            expert_path = ("sequential", f"megatron's loop over the experts ({NO_EXPERT_SLOT})")
    if spec.family.QK_NORM_ACROSS_HEADS:
        use_full_width_qk_norm(block)
    model = GPTModel(config=config, transformer_layer_spec=block,
                     vocab_size=spec.vocab_size,
                     max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
                     pre_process=pre_process, post_process=post_process,
                     share_embeddings_and_output_weights=spec.tie_word_embeddings,
                     **spec.family.rotary(hf))
    if not te_available() and config.add_bias_linear:
        copy_expert_outputs(model)
    for p in model.parameters():   # every weight in ``dtype``, the norms' too (megatron-core's
        if p.is_floating_point() and p.dtype != dtype:   # Float16Module; SGLang serves them so)
            p.data = p.data.to(dtype)
    if not cuda_absent():
        model = model.cuda()
    model.expert_path, model.attention_path = expert_path, attention_path
    model.dispatch_path = _dispatch(model, config, sort_dispatch)
    return model, spec


def _dispatch(model, config, sort_dispatch: bool) -> tuple[str, str]:
    """Every MoE layer's tokens dispatched by sort when all its experts are on this rank (in
    place); (path, why)."""
    local = config.expert_model_parallel_size == 1 and config.expert_tensor_parallel_size == 1
    megatron = config.moe_token_dispatcher_type
    if not (sort_dispatch and local):
        why = ("experts on other ranks" if not local else "asked for megatron's")
        return megatron, f"megatron's {megatron} dispatcher ({why})"
    from moe_rl.trainer.sort_dispatcher import use_sort_dispatcher
    use_sort_dispatcher(model)
    return "sort", "every expert local: permutation by sort, no host synchronisation"
