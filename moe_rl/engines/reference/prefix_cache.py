"""The reference engine's prefix cache, with SGLang's radix-cache semantics where they matter to
RL: a request whose input starts with the tokens of a finished request reuses their stored KV
(those positions are not recomputed, ``cached_tokens`` counts them) and gets back the routing
recorded when that KV was computed. Entries are whole token sequences (prompt + fed generated
tokens); a hit is the longest common prefix with any entry, at most the input minus its last
token (the last input token is always computed, as in SGLang). Least recently used entries are
evicted beyond ``capacity_tokens``; a weight update or ``/flush_cache`` empties it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class CacheEntry:
    ids: tuple[int, ...]
    keys: list[torch.Tensor]       # per layer [H, S, D]
    values: list[torch.Tensor]     # per layer [H, S, Dv]
    routing: torch.Tensor          # [S, L_moe, K]: the routing recorded with this KV
    last_use: int = 0


@dataclass
class CacheHit:
    """The first ``length`` positions of a request, served from ``entry``."""
    entry: CacheEntry
    length: int

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys [1, H, length, D], values [1, H, length, Dv])."""
        n = self.length
        return [(k[None, :, :n], v[None, :, :n])
                for k, v in zip(self.entry.keys, self.entry.values)]

    def routing(self) -> torch.Tensor:
        return self.entry.routing[:self.length]


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Token-sequence -> (KV, routing) store with longest-prefix lookup and LRU eviction."""

    def __init__(self, capacity_tokens: int):
        if capacity_tokens < 0:
            raise ValueError(f"prefix cache capacity: expected >= 0 tokens, got {capacity_tokens}")
        self.capacity = capacity_tokens
        self.entries: list[CacheEntry] = []
        self._clock = 0

    @property
    def tokens(self) -> int:
        return sum(len(e.ids) for e in self.entries)

    def flush(self) -> None:
        """Drop every entry."""
        self.entries = []

    def match(self, ids: list[int], limit: int | None = None) -> CacheHit | None:
        """The longest stored prefix of ``ids`` of at most ``limit`` tokens (default and cap:
        ``len(ids) - 1``), or None."""
        limit = len(ids) - 1 if limit is None else min(limit, len(ids) - 1)
        best, length = None, 0
        for e in self.entries:
            n = _common_prefix(e.ids, ids, limit)
            if n > length:
                best, length = e, n
        if best is None:
            return None
        self._clock += 1
        best.last_use = self._clock
        return CacheHit(best, length)

    def insert(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
               routing: torch.Tensor) -> None:
        """Store the KV and routing of the positions ``ids`` (one row per id), as a radix
        cache inserts a finished request: the positions already stored (the longest common
        prefix with an entry) keep the stored KV and routing, only the new tail is taken from
        this computation; an entry that is a prefix of ``ids`` is absorbed by the new one."""
        if self.capacity == 0 or not ids or len(ids) > self.capacity:
            return
        ids_t = tuple(ids)
        if routing.shape[0] != len(ids) or any(k.shape[-2] != len(ids) for k in keys):
            raise ValueError(f"prefix cache: {len(ids)} ids but KV/routing of "
                             f"{[k.shape[-2] for k in keys[:1]]}/{routing.shape[0]} positions")
        old, m = None, 0
        for e in self.entries:
            n = _common_prefix(e.ids, ids, len(ids))
            if n > m:
                old, m = e, n
        if m == len(ids_t):   # already stored
            return
        if old is not None:
            keys = [torch.cat([ok[:, :m], k[:, m:]], dim=1) for ok, k in zip(old.keys, keys)]
            values = [torch.cat([ov[:, :m], v[:, m:]], dim=1) for ov, v in zip(old.values, values)]
            routing = torch.cat([old.routing[:m], routing[m:]])
        self.entries = [e for e in self.entries
                        if not (len(e.ids) < len(ids_t) and ids_t[:len(e.ids)] == e.ids)]
        self._clock += 1
        self.entries.append(CacheEntry(ids_t, [k.clone() for k in keys],
                                       [v.clone() for v in values], routing.clone(),
                                       self._clock))
        while self.tokens > self.capacity:
            self.entries.remove(min(self.entries, key=lambda e: e.last_use))
