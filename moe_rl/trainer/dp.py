"""Reductions over the data-parallel group (or every trainer rank) that every trainer rank enters
(a no-op on one)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def dp_group():
    """The data-parallel process group, None with one data-parallel rank."""
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None


def dp_max(value: int) -> int:
    """The largest ``value`` of any data-parallel rank."""
    t = torch.tensor([value], dtype=torch.long)
    group = dp_group()
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def dp_sum(values: list[float]) -> list[float]:
    """``values`` summed over the data-parallel ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64)
    group = dp_group()
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.tolist()


def every_rank_sum(values: list[float]) -> list[float]:
    """``values`` summed over every trainer rank (float64): for per-position sums that tensor-
    (with sequence parallelism) and context-parallel ranks each hold a slice of. Ranks holding
    the same positions (tensor parallelism without it) count them alike, which leaves a
    position-weighted mean unchanged."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()
