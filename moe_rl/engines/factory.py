"""The configured engine, by ``rollout.engine``: how many GPUs and weight-group ranks a server
takes, its command line, its server process, and a connected :class:`~moe_rl.engines.base.Engine`
(or only its weight receiver, for the trainer's sender). Each engine package provides the same
functions (``gpus_per_server``, ``weight_ranks_per_server``, ``server_command``,
``check_config``, ``describe``) and says whether its server inherits its socket."""
from __future__ import annotations

from typing import Callable

from moe_rl.config import Config
from moe_rl.engines import reference, sglang
from moe_rl.engines.base import Engine, WeightReceiver
from moe_rl.engines.needs import requests_routing, requests_sampling_mask
from moe_rl.engines.process import CommandServer
from moe_rl.moe_shape import MoEShape

KINDS = {"reference": reference, "sglang": sglang}


def engine_kind(cfg: Config):
    """The engine package of ``rollout.engine``."""
    return KINDS[cfg.rollout.engine]


def engine_description(cfg: Config) -> str:
    """The engine in words, with the dtype it serves where moe_rl sets it."""
    return engine_kind(cfg).describe(cfg)


def gpus_per_server(cfg: Config) -> int:
    """GPUs one server uses (0 on CPU)."""
    return engine_kind(cfg).gpus_per_server(cfg)


def port_span(cfg: Config) -> int:
    """Ports from its own up that one server binds (servers on a node are this far apart)."""
    return engine_kind(cfg).port_span(cfg)


def weight_ranks_per_server(cfg: Config) -> int:
    """Ranks one server takes in the weight-update group."""
    return engine_kind(cfg).weight_ranks_per_server(cfg)


def server_command(cfg: Config, host: str, port: int, gpus: list[int], index: int,
                   model_path: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment moe_rl sets) of server ``index`` on ``host:port``."""
    return engine_kind(cfg).server_command(cfg, host, port, list(gpus), index, model_path)


def server_process(cfg: Config, argv: list[str], env: dict[str, str], host: str, port: int,
                   log_path: str | None = None) -> CommandServer:
    """The supervised process of one server started from ``argv`` / ``env``."""
    return CommandServer(argv, env, host, port, inherits_socket=engine_kind(cfg).INHERITS_SOCKET,
                         api_key=cfg.rollout.api_key, log_path=log_path)


def _pool_factory(cfg: Config, urls: list[str], restarters=None):
    from moe_rl.engines.sglang.pool import ServerPool
    r = cfg.rollout
    return lambda: ServerPool(urls, api_key=r.api_key, timeout=r.request_timeout_s,
                              max_retries=r.max_retries, concurrency=r.concurrency,
                              restarters=restarters, health_timeout=r.health_timeout_s)


def connect(cfg: Config, urls: list[str], layout: MoEShape,
            restarters: list[Callable[[], None] | None] | None = None) -> Engine:
    """The engine over the servers at ``urls`` (both engines speak SGLang's protocol);
    ``restarters[i]`` brings server i back when it dies."""
    from moe_rl.engines.sglang.client import SGLangEngine
    return SGLangEngine(_pool_factory(cfg, urls, restarters), layout,
                        need_routing=requests_routing(cfg),
                        need_mask=requests_sampling_mask(cfg),
                        ranks_per_server=weight_ranks_per_server(cfg))


def weight_receiver(cfg: Config, urls: list[str]) -> WeightReceiver:
    """The weight receiver of the servers at ``urls`` alone (the trainer's side of a sync, or
    one restarted server)."""
    from moe_rl.engines.sglang.client import SGLangWeightReceiver
    return SGLangWeightReceiver(_pool_factory(cfg, urls), weight_ranks_per_server(cfg))
