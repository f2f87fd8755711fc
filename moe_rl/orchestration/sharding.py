"""Cutting a step's samples into data-parallel shards (whole prompt groups per rank)."""
from __future__ import annotations

from moe_rl.types import Sample


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
