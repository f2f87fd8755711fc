"""Forward a packed micro-batch through the megatron model to per-token log-probs and entropy.

The model runs up to its final norm (its own output layer is skipped), and the memory-bounded
kernel scores only the response positions against the output weight, with the engine's
temperature and, optionally, the engine's kept-id sets.
"""
from __future__ import annotations

import contextlib

import torch

from moe_rl.trainer.packing import MicroBatch
from moe_rl.trainer import context_parallel as cp_maps
from moe_rl_kernels.logprob import logprob_entropy


def unwrap(model):
    """The GPTModel inside DDP / other wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


@contextlib.contextmanager
def hidden_states_only(model):
    """Make GPTModel.forward return the final hidden states [S, B, H] instead of logits."""
    gpt = unwrap(model)
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


def output_weight(model) -> torch.Tensor:
    """The (tensor-parallel shard of the) LM-head weight, tied or not."""
    gpt = unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def packed_seq_params(mb: MicroBatch, device):
    """megatron's THD parameters of a packed row: every slot one sequence (its padding inside);
    the slots' bounds read on the host, where the row was packed (nothing waits for the
    device)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    host = mb.cu_seqlens()
    longest = int((host[1:] - host[:-1]).max())
    cu = host.to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    bounds = host.tolist()
    params.moe_rl_slot_bounds = list(zip(bounds[:-1], bounds[1:]))
    return params


def forward_logprobs(model, mb: MicroBatch, *, temperature: float = 1.0,
                     use_kept_sets: bool = False, fp32_output_layer: bool = False,
                     chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [B, S] at every response position (0 elsewhere).

    Position s holds log pi(token s+1 | tokens <= s). With ``use_kept_sets`` the distribution is
    restricted to the engine's kept set at each response position. A packed micro-batch runs
    as THD (``PackedSeqParams`` with its slots' ``cu_seqlens``). Under
    context parallelism each rank forwards and scores its own positions
    (:mod:`moe_rl.trainer.context_parallel`) and the results are gathered back in order.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    gpt = unwrap(model)
    device = output_weight(model).device
    B, S = mb.input_ids.shape
    cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    positions = torch.arange(S)
    kept = mb.kept if use_kept_sets else None
    if use_kept_sets and mb.kept is None:
        raise ValueError("algorithm.keep_sampling_mask: the rollout carries no sampling masks "
                         "(start SGLang with --sampling-mask-max-tokens and request "
                         "return_sampling_mask)")
    # None: causal, which every core attention computes without a mask tensor ([S, S] bools
    # per micro-batch, 1 GiB at 32k tokens, and torch's fused kernels take none)
    mask = (None if (mb.packed or cp > 1 or mb.attention_mask is None)
            else mb.attention_mask.to(device))
    if cp > 1:
        every = cp_maps.every_rank_positions(mb, cp)
        positions = every[ps.get_context_parallel_rank()]
        kept = cp_maps.local_kept(mb, positions) if use_kept_sets else None
    params = packed_seq_params(mb, device) if mb.packed else None
    with hidden_states_only(model):
        hidden = model(mb.input_ids[:, positions].to(device),
                       mb.position_ids[:, positions].to(device), mask,
                       packed_seq_params=params)
    if gpt.config.sequence_parallel:
        # the kernel all-reduces the hidden-state gradient over the TP group itself, so the
        # gather's backward must only slice (tensor_parallel_output_grad=False), not
        # reduce-scatter again (that would make the gradient tp times too large)
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False)
    S_local = positions.numel()
    flat = hidden.transpose(0, 1).reshape(B * S_local, -1)
    rows = mb.response_mask[:, positions].reshape(-1).nonzero().squeeze(1)
    h = flat[rows.to(device)]
    weight = output_weight(model)
    if fp32_output_layer:
        h, weight = h.float(), weight.float()
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    vocab_start = ps.get_tensor_model_parallel_rank() * weight.shape[0] if tp > 1 else 0
    lp, ent = logprob_entropy(h, weight, mb.targets[:, positions].reshape(-1)[rows].to(device),
                              temperature=temperature, kept=kept,
                              chunk_size=chunk_size, tp_group=tp_group,
                              vocab_start=vocab_start)
    out_lp = torch.zeros(B * S_local, dtype=lp.dtype, device=lp.device).index_put(
        (rows.to(lp.device),), lp).reshape(B, S_local)
    out_ent = torch.zeros(B * S_local, dtype=ent.dtype, device=ent.device).index_put(
        (rows.to(ent.device),), ent).reshape(B, S_local)
    if cp > 1:
        group = ps.get_context_parallel_group()
        out_lp = cp_maps.gather_positions(out_lp, every, S, group)
        out_ent = cp_maps.gather_positions(out_ent, every, S, group)
    return out_lp, out_ent
