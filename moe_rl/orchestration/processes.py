"""The run's processes on Ray, as the plan places them: the trainer worker group (one actor per
rank), the engine servers (an :class:`EngineHost` actor each) and the rollout worker; stopping
the servers; and the plan as placed, written to the run directory."""
from __future__ import annotations

import dataclasses
import json
import os

import ray

from moe_rl.config import Config, dump_config
from moe_rl.engines.process import ServerExited
from moe_rl.errors import LossScaleCollapsed, first_line
from moe_rl.orchestration import checkpoint
from moe_rl.orchestration.failures import RunFailed, lost_process
from moe_rl.orchestration.placement import at_addresses, Plan, PlannedProcess
from moe_rl.orchestration.sharding import per_rank
from moe_rl.orchestration.engine_host import EngineHost
from moe_rl.orchestration.rollout_worker import RolloutWorker, served_checkpoint
from moe_rl.orchestration.trainer_worker import TrainerWorker
from moe_rl.trainer.parallel import free_port
from moe_rl.rollout_record import RolloutBatch, Sample


def cfg_tree(cfg: Config) -> dict:
    """The config as a plain tree (what an actor is built from)."""
    import yaml
    return yaml.safe_load(dump_config(cfg))


def engine_hosts(cfg: Config, plan: Plan, reservation, model_path: str, log_dir: str) -> list:
    """An :class:`EngineHost` actor for every engine server of ``plan``, on its node (in its
    node's bundle), each holding its server's port; the servers are not started yet
    (:func:`start_engines`)."""
    os.makedirs(log_dir, exist_ok=True)
    tree = cfg_tree(cfg)
    return [EngineHost.options(**reservation.options(p)).remote(
        tree, dataclasses.asdict(p), plan.nodes, model_path,
        os.path.join(log_dir, f"engine_{p.index}.log")) for p in plan.of("engine")]


def get_unless_stopped(refs: list, stop=None) -> list:
    """``ray.get(refs)``; with ``stop`` (the run's StopRequest) in short waits, so that a stop
    signal during the start-up ends it at once (Abandoned) instead of after the loads."""
    pending = list(refs)
    while stop is not None and pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        stop.check_startup()
    return ray.get(refs)


def start_engines(plan: Plan, hosts: list, stop=None) -> None:
    """Start the servers of ``hosts`` and wait until every one answers /health (a stop signal
    ends the wait: :func:`get_unless_stopped`); the plan's engine entries are updated to the
    address and port each server took."""
    ray.get([h.placed.remote() for h in hosts])   # every port held before any is released
    try:
        placed = get_unless_stopped([h.start.remote() for h in hosts], stop)
    except ray.exceptions.RayTaskError as exc:   # the cause in one line, not Ray's traceback
        if isinstance(exc.cause, ServerExited):
            raise RunFailed(str(exc.cause)) from None
        raise
    engines = iter(PlannedProcess(**d) for d in placed)
    plan.processes = [next(engines) if p.role == "engine" else p for p in plan.processes]


def start_rollout_worker(cfg: Config, plan: Plan, reservation, hosts: list,
                         training: bool = True):
    """The rollout worker actor, on the node the plan gives it, driving ``hosts``
    (``training=False``: for an evaluation only, the training data not read)."""
    return RolloutWorker.options(**reservation.options(plan.of("rollout")[0])).remote(
        cfg_tree(cfg), hosts, training)


def stop_engines(hosts: list, timeout_s: float = 60.0) -> None:
    """Stop every engine server (each host terminates its process, then kills it); a host that
    does not answer within ``timeout_s`` is left to Ray's shutdown."""
    refs = [h.stop.remote() for h in hosts]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)


class ServedEngines:
    """The engine servers of a run or an evaluation (``with``: stopped at its end, a failed or
    stopped start included): :meth:`start` places and starts them serving a model, then
    :meth:`rollout_worker` gives the actor that drives them. Hosts belong to it before their
    servers start, so a stop signal during the load ends them."""

    def __init__(self, cfg: Config, plan: Plan, reservation):
        self.cfg, self.plan, self.reservation = cfg, plan, reservation
        self.hosts: list = []

    def start(self, model_path: str, work_dir: str, stop=None) -> Plan:
        """Serve ``model_path`` (with FP8 rollouts its FP8 checkpoint, written to
        ``work_dir/fp8_start``; a released MXFP4 checkpoint's bfloat16 copy, to
        ``work_dir/bf16_start``; server logs in ``work_dir/logs``); returns the plan with the
        servers' addresses and ports."""
        cfg = self.cfg
        served = served_checkpoint(cfg, model_path, work_dir)
        self.plan = at_addresses(self.plan, cfg, self.reservation.addresses, served)
        self.hosts = engine_hosts(cfg, self.plan, self.reservation, served,
                                  os.path.join(work_dir, "logs"))
        start_engines(self.plan, self.hosts, stop)
        return self.plan

    def rollout_worker(self, training: bool = True):
        """The rollout worker driving the started servers (see :func:`start_rollout_worker`)."""
        return start_rollout_worker(self.cfg, self.plan, self.reservation, self.hosts, training)

    def __enter__(self) -> "ServedEngines":
        return self

    def __exit__(self, *exc) -> None:
        stop_engines(self.hosts)


def write_plan(plan: Plan, reservation, path: str, trainer_addresses: list[str]) -> None:
    """The plan as placed (real addresses and ports, each node's Ray node id, the address each
    trainer rank reports from where it runs) to ``path``."""
    tree = plan.to_json()
    ranks = iter(trainer_addresses)
    for proc in tree["processes"]:
        if proc["role"] == "trainer":
            proc["address"] = next(ranks)
    tree["ray_nodes"] = [{"node": i, "node_id": nid, "address": addr} for i, (nid, addr)
                         in enumerate(zip(reservation.node_ids, reservation.addresses))]
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(tree, fh, indent=1)


class Trainers:
    """The trainer worker group: one Ray actor per rank, on the node and GPU the plan says."""

    def __init__(self, cfg: Config, plan: Plan, reservation):
        tree = cfg_tree(cfg)
        ranks = plan.of("trainer")
        first = reservation.options(ranks[0])
        # the rendezvous lives on rank 0's node: its address, and a port free there
        self.single_node = plan.nodes == 1   # then every rendezvous stays on 127.0.0.1
        address = "127.0.0.1" if plan.nodes == 1 else reservation.addresses[ranks[0].node]
        if plan.nodes == 1 and not cfg.cluster.ray_address:   # the run's own Ray: this node
            port = free_port("127.0.0.1")
        else:
            port = ray.get(ray.remote(free_port).options(
                scheduling_strategy=first["scheduling_strategy"], num_cpus=0).remote(
                "127.0.0.1" if plan.nodes == 1 else address))
        self.actors = [TrainerWorker.options(**reservation.options(p)).remote(
            tree, p.index, len(ranks), address, port, p.gpus[0] if p.gpus else None)
            for p in ranks]
        # tensor- and context-parallel ranks of one data-parallel rank share its samples; the
        # answer comes once every rank has built its model (ready())
        self._data_ranks = [a.data_parallel_rank.remote() for a in self.actors]
        self.data_ranks: list[int] = []
        self.n_data = 0

    def ready(self, stop=None) -> None:
        """Wait until every rank has built its model (the actors build it in their constructor,
        while the driver goes on placing the engines); a stop signal ends the wait
        (:func:`get_unless_stopped`)."""
        if not self.data_ranks:
            self.data_ranks = get_unless_stopped(self._data_ranks, stop)
            self.n_data = max(self.data_ranks) + 1

    def unreachable(self, timeout_s: float = 30.0) -> str | None:
        """The first rank that is gone or does not answer within ``timeout_s`` (after a peer's
        error, e.g. gloo's "Connection closed by peer": which rank was lost), else None."""
        for rank, actor in enumerate(self.actors):
            try:
                ray.get(actor.node_ip.remote(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                return f"trainer rank {rank}: no answer within {timeout_s:g} s"
            except Exception as exc:   # noqa: BLE001  (what Ray says about the rank)
                return f"trainer rank {rank}: {lost_process(exc) or type(exc).__name__}"
        return None

    def compute_paths(self) -> dict[str, tuple[str, str]]:
        """How rank 0's experts, attention and dispatch compute and why (every rank builds
        the same)."""
        return ray.get(self.actors[0].compute_paths.remote())

    def addresses(self) -> list[str]:
        """The node address each rank runs at, as the rank itself sees it."""
        return ray.get([a.node_ip.remote() for a in self.actors])

    def train_step(self, shards: list) -> dict:
        """One RL step; ``shards``: one reference per data-parallel rank to its rollout-batch
        bytes (Ray hands each rank its bytes from the object store; the driver never holds
        them); the tensor- and context-parallel ranks of a data-parallel rank get the same."""
        try:
            return ray.get([a.train_step.remote(ref) for a, ref in
                            zip(self.actors, per_rank(shards, self.data_ranks))])[0]
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, LossScaleCollapsed):   # the run ends with its one line
                raise RunFailed(str(exc.cause)) from None
            raise

    def probe(self, data: bytes) -> list[tuple]:
        """The weight check's trainer side on the probe ``data`` (rollout-batch bytes), held by
        data-parallel rank 0; every rank enters the forward."""
        shards = [data] + [RolloutBatch([]).to_bytes()] * (self.n_data - 1)
        return ray.get([a.probe.remote(d) for a, d in
                        zip(self.actors, per_rank(shards, self.data_ranks))])[0]

    def sft_step(self, samples: list[Sample], lr: float) -> dict:
        shards = [RolloutBatch(samples[i::self.n_data]).to_bytes() for i in range(self.n_data)]
        return ray.get([a.sft_step.remote(data, lr) for a, data in
                        zip(self.actors, per_rank(shards, self.data_ranks))])[0]

    def export(self, out_dir: str, use_ema: bool = False) -> None:
        """A HF checkpoint of the policy (``use_ema``: its exponential moving average)."""
        ray.get([a.export_hf.remote(out_dir, use_ema) for a in self.actors])

    def connect_engines(self, urls: list[str], sources: list[list[int]] | None) -> None:
        """Every rank's weight sender to the servers at ``urls`` (in-memory weight sync)."""
        ray.get([a.connect_engines.remote(urls, sources, self.single_node)
                 for a in self.actors])

    def send_weights(self, version: int, reopen: bool = False) -> dict:
        """The policy to every server as weight ``version`` (the ranks send together; see
        TrainerWorker.send_weights); rank 0's answer: the tensors sent, the transport it
        opened (None when it opened none)."""
        return ray.get([a.send_weights.remote(version, reopen) for a in self.actors])[0]

    def abort_weight_update(self) -> None:
        """After a failed update: close what the servers still have open."""
        ray.get(self.actors[0].abort_weight_update.remote())

    def save(self, path: str) -> None:
        ray.get([a.save.remote(path) for a in self.actors])

    def load(self, path: str) -> int:
        """Every rank loads checkpoint ``path``; a refusal (damaged or crafted files, another
        model or layout) is a CheckpointError naming it."""
        try:
            return ray.get([a.load.remote(path) for a in self.actors])[0]
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise checkpoint.CheckpointError(f"{path}: cannot be loaded ({type(cause).__name__}: "
                                             f"{first_line(cause)})") from None
