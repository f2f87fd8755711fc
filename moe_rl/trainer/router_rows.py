"""What the routers saw of a micro-batch, per token: a rank's router rows (its tensor- and
context-parallel share, in the router's order ``s * B + b``) gathered into the whole micro-batch
[S, B, L, ...], and cut into response-aligned rows per sample."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_rl.trainer.packing import MicroBatch
from moe_rl.trainer import context_parallel as cp_maps


def micro_batch_rows(rows: list[torch.Tensor], mb: MicroBatch, fw, sequence_parallel: bool
                     ) -> torch.Tensor:
    """One [local tokens, ...] tensor per MoE layer, as this rank's routers saw ``mb`` (forwarded
    by ``fw``) -> [S, B, L, ...] for the whole micro-batch. Collective over the tensor-parallel
    group under sequence parallelism and over the context-parallel group: each rank routed a
    slice."""
    from megatron.core import parallel_state as ps
    B, S = mb.input_ids.shape
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if tp > 1 and sequence_parallel:
        group = ps.get_tensor_model_parallel_group()
        full = []
        for t in rows:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            full.append(torch.cat(parts))
        rows = full
    cp = fw.cp_positions(mb)
    if cp is not None:
        every = cp_maps.every_rank_positions(mb, ps.get_context_parallel_world_size())
        rows = [cp_maps.gather_rows(t, every, S, B, ps.get_context_parallel_group())
                for t in rows]
    return torch.stack([t.reshape(S, B, *t.shape[1:]) for t in rows], dim=2)


def response_rows(per: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """[S, B, L, ...] -> [N, R_max, L, ...]: at each sample's positions that score its response
    tokens (as :meth:`MicroBatch.to_response_padded`), zeros beyond a sample's response."""
    slices = mb.response_slices()
    width = int(mb.response_lens.max())
    out = per.new_zeros((len(slices), width, *per.shape[2:]))
    for i, (b, sl) in enumerate(slices):
        out[i, :sl.stop - sl.start] = per[sl, b]
    return out
