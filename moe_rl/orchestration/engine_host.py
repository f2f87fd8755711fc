"""The Ray actor that starts one engine server on its node (:class:`EngineHost`). It imports
neither torch nor the engines' clients: a process that only launches a server and answers for
it stays light (a few seconds of CPU less per server on every run)."""
from __future__ import annotations

import dataclasses

import ray

from moe_rl.config import config_from_dict
from moe_rl.config.schema import ServersConfig


def startup_timeout(servers: ServersConfig) -> float:
    """How long a starting or restarted engine server may take to answer /health:
    ``rollout.servers.startup_timeout_s``, else ``rollout.servers.health_timeout_s``."""
    if servers.startup_timeout_s is None:
        return servers.health_timeout_s
    return servers.startup_timeout_s


@ray.remote(max_concurrency=2)
class EngineHost:
    """One engine server, started on the node and GPUs the plan gave it: binds the node's
    address on a multi-node run, takes the first free port from the planned one on this node,
    and restarts the server when asked. Two calls may run at once: a stop ends a server that
    is still loading (its start then fails at once) instead of waiting behind it."""

    def __init__(self, cfg_tree: dict, planned: dict, nodes: int, model_path: str,
                 log_path: str):
        from moe_rl.engines.factory import engine_kind
        from moe_rl.engines.process import bind_first_free
        from moe_rl.orchestration.placement import PlannedProcess, engine_command, engine_host
        cfg = config_from_dict(cfg_tree)
        self.cfg = cfg
        proc = PlannedProcess(**planned)
        proc.host = engine_host(cfg.rollout.servers, nodes, ray.util.get_node_ip_address())
        # the port is held from here to the launch: hosts sharing an address never collide
        self.sock = bind_first_free(proc.host, proc.port)
        proc.port = self.sock.getsockname()[1]
        proc.argv, proc.env = engine_command(cfg, proc, model_path)
        self.planned = proc
        self.server = engine_kind(cfg).server_process(proc.argv, proc.env, proc.host, proc.port,
                                                      log_path)

    def placed(self) -> dict:
        """The process as placed (its address and the port it holds)."""
        return dataclasses.asdict(self.planned)

    def start(self) -> dict:
        """Start the server on the held port and wait for its /health; returns
        :meth:`placed`."""
        sock, self.sock = self.sock, None
        self.server.start(startup_timeout(self.cfg.rollout.servers), sock=sock)
        return self.placed()

    def url(self) -> str:
        return self.server.url

    def restart(self) -> None:
        self.server.restart(startup_timeout(self.cfg.rollout.servers))

    def restarts(self) -> int:
        return self.server.restarts

    def stop(self) -> None:
        self.server.stop()
