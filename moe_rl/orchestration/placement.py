"""The placement plan: every process a run starts (trainer ranks, engine servers, the rollout
worker), the node and the GPUs of that node it runs on, and for engines the exact command line
and the environment moe_rl gives them; then the weight-update group's ranks. ``moe-rl plan``
prints it and ``moe-rl train`` places its Ray actors and servers by it (one code path).

Rules (GPU runs, ``cluster.gpus_per_node`` G > 0): the GPUs of the run are numbered node by
node (slot ``node * G + gpu``). Trainer rank r takes slot r. Each engine server needs
``tp_size x dp_size`` GPUs (``tp_size`` with ``--enable-dp-attention``) on one node; servers take
the next free slots after the trainer's, moving to the next node when a server would straddle
two, so engines and trainer never share a GPU. With ``cluster.colocate`` the servers start at
slot 0 instead and share the trainer's GPUs (server s, TP rank j on trainer rank
``s * tp_size + j``'s GPU, which the tensor sync relies on). A server sees only its own GPUs
(``CUDA_VISIBLE_DEVICES``, ``--base-gpu-id 0``). CPU runs (G = 0): trainer ranks and servers are
spread over the nodes in contiguous blocks. The rollout worker runs on node 0.

Addresses: a single-node run binds the servers to ``rollout.servers.host``; a multi-node run
binds each server to its node's address (a loopback ``rollout.servers.host`` cannot be reached
from another node). Ports: server k of a node tries ``rollout.servers.base_port + k`` first
(``k x 240`` with SGLang's ``--enable-dp-attention``, under which a server also binds
port+233..port+239) and takes the next free one on that node; the plan ``train`` writes to
``<run>/plan.json`` holds the ports taken."""
from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field

from moe_rl.config import Config, ConfigError
from moe_rl.config.schema import ClusterConfig, ServersConfig
from moe_rl.engines.factory import engine_kind

LOOPBACK_HOSTS = ("localhost",)


@dataclass
class PlannedProcess:
    """One process of the run, with what its Ray actor reserves inside its node's bundle."""
    role: str                      # "trainer" | "engine" | "rollout"
    index: int                     # trainer rank / server index / 0
    node: int
    gpus: list[int]
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    host: str | None = None        # engines: the address the server binds
    port: int | None = None        # engines: the port (preferred one until the server started)
    num_cpus: float = 0.0          # Ray resources of its actor
    num_gpus: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"


@dataclass
class Plan:
    """Every process of a run and the weight-update group's members."""
    nodes: int
    gpus_per_node: int
    processes: list[PlannedProcess]
    weight_update_group: dict | None = None
    tensor_sources: list[list[int]] | None = None   # weight_sync tensor: [server][TP rank]

    def of(self, role: str) -> list[PlannedProcess]:
        return [p for p in self.processes if p.role == role]

    def to_json(self) -> dict:
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "processes": [{k: v for k, v in dataclasses.asdict(p).items()}
                              for p in self.processes],
                "weight_update_group": self.weight_update_group,
                "tensor_sources": self.tensor_sources}

    def node_resources(self) -> list[dict[str, float]]:
        """The Ray resources each node's processes reserve (one placement-group bundle per
        node): CPUs, and the distinct GPUs used there."""
        out = []
        for n in range(self.nodes):
            procs = [p for p in self.processes if p.node == n]
            cpus = sum(p.num_cpus for p in procs)
            gpus = len({g for p in procs for g in p.gpus})
            res = {"CPU": max(cpus, 1.0)}   # a node of engines alone: its hosts' CPU
            if gpus:
                res["GPU"] = float(gpus)
            out.append(res)
        return out


def ray_resources(cluster: ClusterConfig, proc: PlannedProcess) -> dict[str, float]:
    """What ``proc``'s Ray actor reserves inside its node's bundle."""
    if proc.role == "trainer":
        return {"num_cpus": cluster.cpus_per_worker, "num_gpus": float(len(proc.gpus))}
    if proc.role == "engine":   # colocated engines use the trainer's reservation
        return {"num_cpus": 0.0,
                "num_gpus": 0.0 if cluster.colocate else float(len(proc.gpus))}
    return {"num_cpus": 1.0, "num_gpus": 0.0}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in LOOPBACK_HOSTS


def engine_host(servers: ServersConfig, nodes: int, node_address: str) -> str:
    """The address a server binds: ``rollout.servers.host``; on a multi-node run a loopback
    ``rollout.servers.host`` is replaced by the node's address."""
    host = servers.host
    return node_address if nodes > 1 and is_loopback(host) else host


def engine_command(cfg: Config, proc: PlannedProcess, model_path: str
                   ) -> tuple[list[str], dict[str, str]]:
    """(argv, environment moe_rl sets) of engine ``proc`` at its host and port."""
    return engine_kind(cfg).server_command(proc.host, proc.port, proc.gpus, proc.index,
                                            model_path)


def _spread(count: int, nodes: int) -> list[int]:
    """Node of each of ``count`` processes spread over ``nodes`` in contiguous blocks."""
    return [i * nodes // count for i in range(count)]


def _gpu_layout(cfg: Config, nodes: int, G: int
                ) -> tuple[list[PlannedProcess], list[int], list[list[int]]]:
    """GPU runs: the trainer ranks, and each engine server's node and GPUs (see the rules)."""
    c, r = cfg.cluster, cfg.rollout
    E = engine_kind(cfg).gpus_per_server()
    if c.trainer_workers > nodes * G:
        raise ConfigError(f"cluster.trainer_workers: {c.trainer_workers} ranks need as many "
                          f"GPUs; the cluster has {nodes} x {G} (cluster.num_nodes x "
                          f"cluster.gpus_per_node)")
    trainers = [PlannedProcess("trainer", rank, rank // G, [rank % G])
                for rank in range(c.trainer_workers)]
    if E > G:
        raise ConfigError(f"rollout.sglang.tp_size: a server needs {E} GPUs on one node "
                          f"(tp_size x dp_size), more than cluster.gpus_per_node = {G}")
    slot = 0 if c.colocate else c.trainer_workers
    engine_slots = []
    for _ in range(r.num_servers):
        if E and slot % G + E > G:   # never straddle two nodes
            slot = (slot // G + 1) * G
        engine_slots.append(slot)
        slot += E
    if slot > nodes * G:
        beside = ("on the trainer GPUs" if c.colocate else
            f"beside {c.trainer_workers} trainer GPUs")
        raise ConfigError(
            f"rollout.num_servers: {r.num_servers} servers of {E} GPUs {beside} need {slot} GPU "
            f"slots; the cluster has {nodes} x {G} = {nodes * G} (cluster.num_nodes x "
            f"cluster.gpus_per_node)")
    if c.colocate and slot > c.trainer_workers:
        raise ConfigError(f"cluster.colocate: {r.num_servers} servers of {E} GPUs need "
                          f"{slot} GPUs, more than the {c.trainer_workers} trainer GPUs "
                          f"they share (cluster.trainer_workers)")
    return (trainers, [s // G for s in engine_slots],
            [list(range(s % G, s % G + E)) for s in engine_slots])


def make_plan(cfg: Config, nodes: int | None = None, gpus_per_node: int | None = None,
              node_addresses: list[str] | None = None, model_path: str | None = None) -> Plan:
    """The plan of ``cfg`` on ``nodes`` x ``gpus_per_node`` (default: the ``cluster`` keys);
    ``node_addresses``: each node's address (default: placeholders ``<node N address>``, which
    :func:`at_addresses` replaces once the nodes are known); ``model_path``: the checkpoint
    the engines serve (default ``model.path``). ConfigError when the run does not fit, naming
    the keys and the numbers."""
    c, r = cfg.cluster, cfg.rollout
    nodes = c.num_nodes if nodes is None else nodes
    G = c.gpus_per_node if gpus_per_node is None else gpus_per_node
    if nodes < 1 or G < 0:
        raise ConfigError(f"cluster.num_nodes / gpus_per_node: expected >= 1 and >= 0, got "
                          f"{nodes} / {G}")
    if G > 0:
        procs, engine_nodes, engine_gpu_lists = _gpu_layout(cfg, nodes, G)
    else:   # CPU runs: spread in contiguous blocks
        procs = [PlannedProcess("trainer", rank, node, [])
                 for rank, node in enumerate(_spread(c.trainer_workers, nodes))]
        engine_nodes = _spread(r.num_servers, nodes)
        engine_gpu_lists = [[] for _ in range(r.num_servers)]
    on_node: dict[int, int] = {}
    for s, (node, gpus) in enumerate(zip(engine_nodes, engine_gpu_lists)):
        k = on_node.get(node, 0)
        on_node[node] = k + 1
        procs.append(PlannedProcess("engine", s, node, gpus,
                                    port=r.servers.base_port + k * engine_kind(cfg).port_span()))
    procs.append(PlannedProcess("rollout", 0, 0, []))
    for p in procs:
        res = ray_resources(cfg.cluster, p)
        p.num_cpus, p.num_gpus = res["num_cpus"], res["num_gpus"]
    plan = Plan(nodes, G, procs)
    plan.weight_update_group = weight_group_plan(cfg, plan)
    plan.tensor_sources = tensor_sources(cfg, plan)
    return at_addresses(plan, cfg, node_addresses or [f"<node {n} address>"
                                                       for n in range(nodes)], model_path)


def at_addresses(plan: Plan, cfg: Config, node_addresses: list[str],
                 model_path: str | None = None) -> Plan:
    """``plan`` with each engine's bind address and command for the nodes' addresses and the
    checkpoint the engines serve (``model_path``, default ``model.path``); nothing else of the
    layout changes."""
    processes = []
    for p in plan.processes:
        if p.role == "engine":
            p = dataclasses.replace(p, host=engine_host(cfg.rollout.servers, plan.nodes,
                                                         node_addresses[p.node]))
            p.argv, p.env = engine_command(cfg, p, model_path or cfg.model.path)
        processes.append(p)
    return dataclasses.replace(plan, processes=processes)


def tensor_sources(cfg: Config, plan: Plan) -> list[list[int]] | None:
    """``cluster.weight_sync: tensor``: for server s's TP rank j, the trainer rank on the same
    node and GPU (SGLang's TP rank opens the CUDA tensors that rank shares), as the plan placed
    them (a server moved to the next node included). ConfigError naming the server, TP rank,
    node and GPU that no trainer rank shares."""
    if cfg.cluster.weight_sync != "tensor":
        return None
    on_gpu = {(p.node, g): p.index for p in plan.of("trainer") for g in p.gpus}
    out = []
    for server in plan.of("engine"):
        ranks = []
        for j, gpu in enumerate(server.gpus[:engine_kind(cfg).weight_ranks_per_server()]):
            if (server.node, gpu) not in on_gpu:
                raise ConfigError(f"cluster.weight_sync: 'tensor' needs a trainer rank on the GPU "
                                  f"of every SGLang TP rank; server {server.index}'s TP rank {j} "
                                  f"(node {server.node}, GPU {gpu}) has none: use 'distributed' "
                                  f"or 'disk', or place trainer ranks on every server GPU")
            ranks.append(on_gpu[(server.node, gpu)])
        out.append(ranks)
    return out


def weight_group_plan(cfg: Config, plan: Plan) -> dict | None:
    """The weight-update group of ``cluster.weight_sync: distributed``: rank 0 is trainer rank
    0, server s's TP rank j is rank ``1 + s * ranks_per_server + j``."""
    if cfg.cluster.weight_sync != "distributed":
        return None
    per = engine_kind(cfg).weight_ranks_per_server()
    t0 = plan.of("trainer")[0]
    ranks = [{"rank": 0, "process": t0.name, "node": t0.node, "gpu": (t0.gpus or [None])[0]}]
    for e in plan.of("engine"):
        for j in range(per):
            ranks.append({"rank": 1 + e.index * per + j, "process": f"{e.name} tp {j}",
                          "node": e.node, "gpu": e.gpus[j] if e.gpus else None})
    return {"backend": "nccl" if plan.gpus_per_node > 0 else "gloo",
            "world_size": len(ranks), "ranks": ranks}


def idle_gpus(plan: Plan) -> int:
    """GPUs of the plan's nodes that no process of it uses."""
    used = {(p.node, g) for p in plan.processes for g in p.gpus}
    return plan.nodes * plan.gpus_per_node - len(used)


def format_plan(plan: Plan) -> str:
    """The plan as a person reads it."""
    lines = [f"{plan.nodes} node(s) x {plan.gpus_per_node} GPU(s)"]
    for p in plan.processes:
        gpus = ",".join(map(str, p.gpus)) if p.gpus else "-"
        lines.append(f"{p.name:<10} node {p.node}  gpus {gpus}")
        if p.role == "engine":
            lines.append(f"           listens on {p.host}:{p.port}")
            lines.append("           env " + " ".join(f"{k}={v}" for k, v in p.env.items()))
            lines.append("           argv " + " ".join(p.argv))
    g = plan.weight_update_group
    if g:
        lines.append(f"weight-update group ({g['backend']}, world size {g['world_size']}):")
        for m in g["ranks"]:
            gpu = "-" if m["gpu"] is None else m["gpu"]
            lines.append(f"  rank {m['rank']:<3} {m['process']:<16} node {m['node']}  gpu {gpu}")
    return "\n".join(lines)
