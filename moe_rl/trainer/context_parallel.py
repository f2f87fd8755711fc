"""Context parallelism's index maps: which positions of a micro-batch each CP rank holds, and the
gather that puts per-rank results back in sequence order.

megatron's load-balanced layout cuts a sequence in 2·CP equal chunks and gives rank r chunks r
and 2·CP-1-r (causal attention's work is then equal on every rank). A padded micro-batch [B, S]
is cut along S, the same positions for every row; a packed row is cut slot by slot (Transformer
Engine's THD partitioning): rank r holds chunks r and 2·CP-1-r of every slot, slots in order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_rl.trainer.packing import MicroBatch
from moe_rl_kernels.logprob import KeptSets


def chunk_positions(start: int, length: int, rank: int, size: int) -> torch.Tensor:
    """Positions of chunks ``rank`` and ``2·size-1-rank`` of the span [start, start+length)."""
    if length % (2 * size):
        raise ValueError(f"context parallelism: a span of {length} positions does not split in "
                         f"2 x {size} chunks")
    c = length // (2 * size)
    return torch.cat([torch.arange(start + rank * c, start + (rank + 1) * c),
                      torch.arange(start + (2 * size - 1 - rank) * c,
                                   start + (2 * size - rank) * c)])


def local_positions(mb: MicroBatch, rank: int, size: int) -> torch.Tensor:
    """The positions (increasing) of ``mb``'s rows that context-parallel rank ``rank`` holds."""
    if not mb.packed:
        return chunk_positions(0, mb.shape[1], rank, size)
    cu = mb.cu_seqlens().tolist()
    return torch.cat([chunk_positions(a, b - a, rank, size) for a, b in zip(cu, cu[1:])])


def every_rank_positions(mb: MicroBatch, size: int) -> torch.Tensor:
    """[size, S_local]: row r holds the positions context-parallel rank r holds."""
    return torch.stack([local_positions(mb, r, size) for r in range(size)])


def local_kept(mb: MicroBatch, positions: torch.Tensor) -> KeptSets | None:
    """``mb.kept`` cut to the response positions among ``positions`` (b-major, as the
    kernel's rows on this rank)."""
    if mb.kept is None:
        return None
    flat = mb.response_mask.reshape(-1)
    row_of = (flat.cumsum(0) - 1).reshape(mb.shape)   # response-row index of each position
    mine = row_of[:, positions][mb.response_mask[:, positions]]
    return mb.kept.subset(mine)


class _GatherPositions(torch.autograd.Function):
    """[B, S_local] per rank -> [B, S] in order; backward keeps this rank's positions' gradient
    (each CP rank computes the whole loss, so the sum over ranks is the full gradient)."""

    @staticmethod
    def forward(ctx, local, positions, seq_len, group):
        parts = [torch.empty_like(local) for _ in range(positions.shape[0])]
        dist.all_gather(parts, local.contiguous(), group=group)
        out = local.new_zeros(local.shape[0], seq_len)
        for pos, part in zip(positions, parts):
            out[:, pos.to(out.device)] = part
        ctx.mine = positions[dist.get_rank(group)].to(local.device)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.mine], None, None, None


def gather_positions(local: torch.Tensor, positions: torch.Tensor, seq_len: int,
                     group) -> torch.Tensor:
    """Each CP rank's values [B, S_local] at its ``positions[rank]`` (``positions``: [CP,
    S_local], every rank's map) gathered into [B, seq_len] (differentiable)."""
    return _GatherPositions.apply(local, positions, seq_len, group)


def gather_rows(local: torch.Tensor, positions: torch.Tensor, seq_len: int, batch: int,
                group) -> torch.Tensor:
    """Router-order rows [S_local*B, K] of every CP rank (its routers' record) -> the whole
    micro-batch's rows [S*B, K] in router order s*B + b."""
    parts = [torch.empty_like(local) for _ in range(positions.shape[0])]
    dist.all_gather(parts, local.contiguous(), group=group)
    out = local.new_zeros(seq_len, batch, *local.shape[1:])
    for pos, part in zip(positions, parts):
        out[pos] = part.reshape(pos.numel(), batch, *local.shape[1:])
    return out.reshape(seq_len * batch, *local.shape[1:])
