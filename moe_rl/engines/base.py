"""The engine contract: what the rollout (single- and multi-turn trajectories, dynamic sampling,
rewards, engine_avg scoring) and the weight sync ask of an inference engine, whichever it is.

- :class:`Engine`: open a :class:`EngineSession` (``run``) to generate turns concurrently, pinned
  to one server when a trajectory needs its prefix cache; score finished samples with ``n``
  passes; take new weights through its :class:`WeightReceiver`; release and resume memory
  (colocated training); flush caches; health; the weight version each server serves.
- :class:`Turn`: one generation decoded (ids, rollout log-probs, routing rows, kept sets, weight
  version). :class:`ResponseError` when an engine's answer cannot become one.

Every implementation passes ``tests/test_engine_contract.py``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import torch

from moe_rl.moe_shape import MoEShape

T = TypeVar("T")


class ResponseError(ValueError):
    """An engine response that cannot become a rollout record; the message says how to fix it."""


class EngineError(RuntimeError):
    """A request every server refused or that kept failing after its retries."""


@dataclass(frozen=True)
class SamplingConfig:
    """How a turn samples (SGLang's sampling_params)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()   # besides end of text (a tool call's closing token)

    def to_json(self, seed: int | None = None) -> dict:
        out = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
               "min_p": self.min_p, "max_new_tokens": self.max_new_tokens}
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if seed is not None:
            out["sampling_seed"] = seed
        return out


@dataclass
class Turn:
    """One generation decoded: the generated ids and, per generated token, its rollout log-prob
    (on the kept set with the sampling mask), kept set and kept mass; the routing rows of the
    positions from the turn's ``routing_from`` on."""
    output_ids: list[int]
    logprobs: torch.Tensor
    routing: torch.Tensor | None
    kept_offsets: torch.Tensor | None
    kept_ids: torch.Tensor | None
    kept_logmass: torch.Tensor | None
    weight_version: int
    finish_reason: dict
    cached_tokens: int


class EngineSession(ABC):
    """The engine's servers open for one batch of concurrent calls (one event loop)."""

    @property
    @abstractmethod
    def num_servers(self) -> int:
        """Servers behind the engine (``server`` arguments are taken modulo this)."""

    @abstractmethod
    async def generate_turn(self, input_ids: list[int], sampling: SamplingConfig, *,
                            seed: int | None = None, routing_from: int | None = None,
                            server: int | None = None) -> Turn:
        """Generate after ``input_ids``; the routing of positions from ``routing_from`` on
        (None: of every position, the engine's default);
        ``server`` pins the request to that server (a trajectory's turns share its prefix
        cache), None sends it to the least-loaded one."""

    @abstractmethod
    async def routing(self, input_ids: list[int], start: int, *, server: int) -> torch.Tensor:
        """The routing of positions ``start .. len(input_ids) - 2`` as ``server`` holds it now
        (after a turn that recomputed positions already received)."""


class WeightReceiver(ABC):
    """How the engine's servers take new weights: a checkpoint on disk, tensors broadcast over
    a process group joined with the trainer, or tensors handed over on shared GPUs. Sessions
    (``begin`` .. ``end``) enclose the in-memory paths."""

    ranks_per_server: int = 1   # weight-update group ranks each server takes

    @abstractmethod
    def load_from_disk(self, path: str, version: int) -> None:
        """Every server loads the HF checkpoint at ``path`` and reports ``version``."""

    @abstractmethod
    def join_group(self, address: str, port: int, group_name: str, backend: str,
                   previous: str | None = None) -> None:
        """Every server joins the trainer's group ``group_name`` (server i: ranks
        ``1 + i * ranks_per_server ..``; rank 0, the trainer, joins concurrently), leaving
        ``previous`` first."""

    @abstractmethod
    def begin(self) -> None:
        """Open every server's weight-update session."""

    @abstractmethod
    def end(self, missing_ok: bool = False) -> None:
        """Close every server's session (``missing_ok``: a server without one is no error)."""

    @abstractmethod
    def announce_bucket(self, named: list[tuple[str, torch.Tensor]], version: int,
                        group_name: str, last: bool) -> None:
        """Every server receives the bucket ``named`` that the trainer broadcasts meanwhile over
        group ``group_name`` (``last``: the update's final bucket)."""

    @abstractmethod
    def receive_tensors(self, payloads: list[list[str]], version: int, last: bool) -> None:
        """Server s loads ``payloads[s]`` (one serialised bucket per TP rank, tensors on the
        GPUs it shares with the trainer)."""


class Engine(ABC):
    """An inference engine of one or more servers, as the rollout and the weight sync use it."""

    layout: MoEShape
    need_routing: bool   # every turn returns its routing
    need_mask: bool      # every turn returns its kept sets and post-truncation log-probs

    @abstractmethod
    def run(self, fn: Callable[[EngineSession], Awaitable[T]]) -> T:
        """Run ``fn(session)`` to completion on a fresh session."""

    @abstractmethod
    def score(self, samples: list, n_passes: int, temperature: float = 1.0,
              window: int = 32) -> None:
        """Fill every sample's ``pass_logprobs`` [n, R] with ``n_passes`` scoring passes, each
        the distribution the trainer scores as pi_theta."""

    @property
    @abstractmethod
    def weights(self) -> WeightReceiver:
        """The servers' weight receiver."""

    @abstractmethod
    def release_memory(self) -> None:
        """Colocated training: the servers free their weights and cache until resumed."""

    @abstractmethod
    def resume_memory(self) -> None:
        """Colocated training: the servers take their memory back."""

    @abstractmethod
    def flush_cache(self) -> None:
        """Drop every server's prefix cache."""

    @abstractmethod
    def check_health(self) -> None:
        """Every server answers; a dead one is restarted first (EngineError when it cannot
        be)."""

    @abstractmethod
    def weight_versions(self) -> list[str]:
        """The weight version each server serves."""
