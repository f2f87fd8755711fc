"""Forward a packed micro-batch through the megatron model to per-token log-probs and entropy.

The model runs up to its final norm (its own output layer is skipped), and the memory-bounded
kernel scores only the response positions against the output weight, with the engine's
temperature and, optionally, the engine's kept-id sets.
"""
from __future__ import annotations

import contextlib

import torch

from moe_rl.packing import MicroBatch
from moe_rl_kernels import logprob_entropy


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


def forward_logprobs(model, mb: MicroBatch, *, temperature: float = 1.0,
                     use_kept_sets: bool = False, fp32_output_layer: bool = False,
                     chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [B, S] at every response position (0 elsewhere).

    Position s holds log pi(token s+1 | tokens <= s). With ``use_kept_sets`` the distribution is
    restricted to the engine's kept set at each response position.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    gpt = unwrap(model)
    device = output_weight(model).device
    with hidden_states_only(model):
        hidden = model(mb.input_ids.to(device), mb.position_ids.to(device),
                       mb.attention_mask.to(device))
    if gpt.config.sequence_parallel:
        # the kernel all-reduces the hidden-state gradient over the TP group itself, so the
        # gather's backward must only slice (tensor_parallel_output_grad=False), not
        # reduce-scatter again (that would make the gradient tp times too large)
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False)
    B, S = mb.input_ids.shape
    flat = hidden.transpose(0, 1).reshape(B * S, -1)
    rows = mb.response_mask.reshape(-1).nonzero().squeeze(1)
    h = flat[rows.to(device)]
    weight = output_weight(model)
    if fp32_output_layer:
        h, weight = h.float(), weight.float()
    if use_kept_sets and mb.kept is None:
        raise ValueError("algorithm.keep_sampling_mask: the rollout carries no sampling masks "
                         "(start SGLang with --sampling-mask-max-tokens and request "
                         "return_sampling_mask)")
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    vocab_start = ps.get_tensor_model_parallel_rank() * weight.shape[0] if tp > 1 else 0
    lp, ent = logprob_entropy(h, weight, mb.targets.reshape(-1)[rows].to(device),
                              temperature=temperature, kept=mb.kept if use_kept_sets else None,
                              chunk_size=chunk_size, tp_group=tp_group,
                              vocab_start=vocab_start)
    out_lp = torch.zeros(B * S, dtype=lp.dtype, device=lp.device).index_put(
        (rows.to(lp.device),), lp)
    out_ent = torch.zeros(B * S, dtype=ent.dtype, device=ent.device).index_put(
        (rows.to(ent.device),), ent)
    return out_lp.reshape(B, S), out_ent.reshape(B, S)
