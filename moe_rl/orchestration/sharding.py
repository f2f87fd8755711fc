"""Cutting a step's samples into data-parallel shards (whole prompt groups per rank)."""
from __future__ import annotations

from moe_rl.rollout_record import Sample


def shard_by_group(samples: list[Sample], ranks: int) -> list[list[Sample]]:
    """Whole prompt groups per data-parallel rank, balanced by token count."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    shards: list[list[Sample]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for g in sorted(groups, key=lambda g: -sum(s.prompt_len + s.response_len for s in groups[g])):
        i = load.index(min(load))
        shards[i] += groups[g]
        load[i] += sum(s.prompt_len + s.response_len for s in groups[g])
    return shards


def per_rank(shards: list, data_ranks: list[int]) -> list:
    """The shard of every trainer rank: its data-parallel rank's (``data_ranks``, one per rank,
    megatron's layout), so the tensor- and context-parallel ranks of one data-parallel rank
    forward the same samples."""
    if sorted(set(data_ranks)) != list(range(len(shards))):
        raise ValueError(f"data-parallel ranks {sorted(set(data_ranks))} do not match "
                         f"{len(shards)} shards")
    return [shards[d] for d in data_ranks]
