"""The engine contract: what the rollout (single- and multi-turn trajectories, dynamic sampling,
rewards, engine_avg scoring) and the weight sync ask of an inference engine, whichever it is.

- :class:`Engine`: open a :class:`EngineSession` (``run``) to generate turns concurrently, pinned
  to one server when a trajectory needs its prefix cache; score finished samples with ``n``
  passes; take new weights through its :class:`WeightReceiver`; release and resume memory
  (colocated training); flush caches; health; the weight version each server serves.
- :class:`WeightSender`: a trainer rank's side of an in-memory weight update (open the
  transport, send named tensors by bucket with a version, abort), one class per transport.
- :class:`EngineKind`: one kind of engine (``rollout.engine``) as one object: how many GPUs,
  ports and weight-group ranks a server takes, its command line and process, the configurations
  it refuses, and its engine, receiver and sender over running servers.
- :class:`Turn`: one generation decoded (ids, rollout log-probs, routing rows, kept sets, weight
  version). :class:`ResponseError` when an engine's answer cannot become one.

Every implementation passes ``tests/engines/test_contract.py``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, TypeVar

from moe_rl.engines.process import CommandServer

if TYPE_CHECKING:   # torch only in annotations: a process that starts a server needs none
    import torch

    from moe_rl.config import Config
    from moe_rl.families.shape import MoEShape

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
    token_versions: list[int] | None = None   # per generated token, when an update landed
                                              # during the request (SGLang's weight_versions)
    retractions: int = 0   # times the engine retracted it under KV-pool pressure (re-prefilled)
    discarded: int = 0     # tokens an abort answered without the routing / kept sets asked for

    @property
    def aborted(self) -> bool:
        """Stopped by an abort before it finished (what it generated is kept)."""
        return self.finish_reason.get("type") == "abort"


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
    async def abort_all(self) -> None:
        """Stop every request in flight on every server: each answers with what it generated so
        far, finish_reason ``abort`` (SGLang's ``/abort_request`` with ``abort_all``)."""

    @abstractmethod
    async def routing(self, input_ids: list[int], start: int, *, server: int) -> torch.Tensor:
        """The routing of positions ``start .. len(input_ids) - 2`` as ``server`` holds it now
        (after a turn that recomputed positions already received)."""


class WeightReceiver(ABC):
    """How the engine's servers take new weights from disk (every engine). An engine that
    also takes them in memory says how in its own receiver and sender (SGLang's:
    :class:`moe_rl.engines.sglang.client.SGLangWeightReceiver`)."""

    @abstractmethod
    def load_from_disk(self, path: str, version: int) -> None:
        """Every server loads the HF checkpoint at ``path`` and reports ``version``."""


Bucket = list[tuple[str, "torch.Tensor"]]   # HF-named tensors sent together


class WeightSender(ABC):
    """A trainer rank's side of an in-memory weight update, one class per transport. Every
    trainer rank calls :meth:`send` together (a collective over the trainer's ranks); rank 0
    talks to the servers through their :class:`WeightReceiver`."""

    everywhere: bool = False   # every rank streams whole buckets (else rank 0 alone holds them)

    @property
    def opened(self) -> bool:
        """Whether the transport is ready to send (a transport without a group always is)."""
        return True

    def open(self, address: str, port: int) -> str | None:
        """Rank 0: (re)build the transport with every server, meeting at ``address:port``;
        returns what was built, in words for the run's log (None: nothing to build, the
        default)."""
        return None

    @abstractmethod
    def send(self, buckets: Iterable[tuple[Bucket, bool]], version: int) -> int:
        """Collective: hand every server ``buckets`` ((tensors, last bucket) in order) as weight
        ``version``; returns the tensors sent (counted on rank 0). A failure is raised after
        the stream ended, so no rank is left waiting in a collective."""

    @abstractmethod
    def abort(self) -> None:
        """After a failed update: close whatever update the servers still have open (a
        restarted server has none)."""


class Engine(ABC):
    """An inference engine of one or more servers, as the rollout and the weight sync use it."""

    moe_shape: MoEShape
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


class EngineKind(ABC):
    """One kind of engine (``rollout.engine``) under one configuration: what a server takes
    (GPUs, ports, weight-group ranks), its command line and supervised process, what the kind
    refuses, and its :class:`Engine`, :class:`WeightReceiver` and :class:`WeightSender` over
    running servers."""

    inherits_socket: bool = False   # the server serves on the socket its parent bound

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @abstractmethod
    def describe(self) -> str:
        """The engine in words, with the dtype it serves where moe_rl sets it."""

    @abstractmethod
    def gpus_per_server(self) -> int:
        """GPUs one server uses (0 on CPU)."""

    def port_span(self) -> int:
        """Ports from its own up that one server binds (servers on a node are this far
        apart)."""
        return 1

    def gpu_memory(self, hf: dict, params: int, gpu_bytes: float):
        """What one GPU of a server holds (``moe_rl.config.memory_estimate.EngineMemory``) for the
        model ``hf`` of ``params`` parameters on GPUs of ``gpu_bytes``; None for a kind
        without GPUs."""
        return None

    def weight_ranks_per_server(self) -> int:
        """Ranks one server takes in the weight-update group."""
        return 1

    def check_node(self) -> tuple[str, str, str]:
        """`moe-rl doctor`'s check of this engine's environment on this node: (ok | warn |
        fail, what was found, the fix). By default the engine runs in moe_rl's own."""
        return ("ok", f"{self.describe()}: runs in this environment", "")

    def check_config(self) -> None:
        """Refuse (ConfigError, naming the key) what this kind cannot run; nothing by
        default."""

    def config_warnings(self) -> list[str]:
        """What this kind serves differently from the trainer and a user should hear of at
        the start (``warning: ...`` lines); none by default."""
        return []

    @abstractmethod
    def server_command(self, host: str, port: int, gpus: list[int], index: int,
                       model_path: str) -> tuple[list[str], dict[str, str]]:
        """(argv, environment moe_rl sets) of server ``index`` on ``host:port``."""

    def server_process(self, argv: list[str], env: dict[str, str], host: str, port: int,
                       log_path: str | None = None) -> CommandServer:
        """The supervised process of one server started from ``argv`` / ``env``."""
        return CommandServer(argv, env, host, port, inherits_socket=self.inherits_socket,
                             api_key=self.cfg.rollout.servers.api_key, log_path=log_path)

    @abstractmethod
    def connect(self, urls: list[str], moe_shape: MoEShape,
                restarters: list[Callable[[], None] | None] | None = None) -> Engine:
        """The engine over the servers at ``urls``; ``restarters[i]`` brings server i back
        when it dies."""

    @abstractmethod
    def receiver(self, urls: list[str]) -> WeightReceiver:
        """The weight receiver of the servers at ``urls`` alone (one restarted server, or the
        trainer's side of a sync)."""

    @abstractmethod
    def sender(self, urls: list[str], rank: int,
               sources: list[list[int]] | None = None) -> WeightSender:
        """Trainer rank ``rank``'s sender to the servers at ``urls`` for
        ``cluster.weight_sync`` (``sources[s][j]``: the trainer rank that feeds server s's
        tensor-parallel rank j, for the colocated tensor path)."""
