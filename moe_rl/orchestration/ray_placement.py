"""The placement plan made real on a Ray cluster: one placement-group bundle per plan node (the
CPUs and GPUs its processes reserve; on several nodes ``STRICT_SPREAD``, so plan node i is one
Ray node of its own), and the Ray options that put each process's actor in its node's bundle."""
from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import ray

from moe_rl.config import Config
from moe_rl.errors import first_line
from moe_rl.orchestration.ray_leftovers import mark_ray_session, reap_orphaned_ray_agents
from moe_rl.orchestration.failures import RunFailed
from moe_rl.orchestration.placement import Plan, PlannedProcess

# Trainer ranks choose their GPU themselves (the plan's index, torch.cuda.set_device); Ray must
# not narrow CUDA_VISIBLE_DEVICES to the one it would have picked.
NO_RAY_CUDA_VISIBLE = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
RAY_AUTH_MODE = "RAY_AUTH_MODE"


def choose_local_ray_auth() -> None:
    """Token authentication for the run's own local Ray, chosen explicitly: Ray 2.60 turns it
    on by default for a new local cluster and warns on every run that it did. ``RAY_AUTH_MODE``
    given by the user is kept as it is."""
    if os.environ.get(RAY_AUTH_MODE):
        return
    os.environ[RAY_AUTH_MODE] = "token"
    config = getattr(ray._raylet, "Config", None)
    if config is not None:       # a Ray imported before the choice re-reads its settings
        config.initialize("")


def start_ray(cfg: Config, plan: Plan) -> bool:
    """Connect to ``cluster.ray_address`` or start a local Ray with the CPUs the plan reserves;
    whether this call connected (False: the caller's Ray was already up)."""
    if ray.is_initialized():
        return False
    if cfg.cluster.ray_address:
        try:
            ray.init(address=cfg.cluster.ray_address, log_to_driver=False)
        except Exception as exc:   # noqa: BLE001  (Ray's own errors, of many kinds)
            raise RunFailed(f"cluster.ray_address: could not join the Ray cluster at "
                            f"{cfg.cluster.ray_address}: {first_line(exc)}; is `ray start "
                            f"--head` running there, reachable from this node?") from None
        return True
    for line in reap_orphaned_ray_agents():
        print(line, file=sys.stderr)
    choose_local_ray_auth()
    need = sum(b["CPU"] for b in plan.node_resources())
    try:   # address="local": a new Ray of its own, never a cluster another run left behind
        ray.init(address="local", num_cpus=max(math.ceil(need), os.cpu_count() or 1),
                 log_to_driver=False, include_dashboard=False)
    except Exception as exc:   # noqa: BLE001  (a bare Exception when its node does not come up)
        temp = os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), "ray")
        raise RunFailed(f"Ray did not start on this node: {first_line(exc)} (a machine too "
                        f"busy for Ray's processes to start within its 30 s does this: try "
                        f"again; Ray's own logs are under {temp}/session_latest/logs)") from None
    mark_ray_session(ray._private.worker.global_worker.node.get_session_dir_path(),
                     cfg.logging.dir)
    return True


def stopped_from_outside(wait_s: float = 5.0) -> str | None:
    """While the run is going, when a process of the local Ray this driver started has ended
    (the run stops them only at its end: so ``ray stop`` of another job of this user, or a
    kill): which one and how (the signal, or the exit code of a graceful stop); None otherwise,
    and when the run joined a cluster it did not start. A process stopping gracefully is
    waited for up to ``wait_s`` (its workers' deaths reach the run first)."""
    node = getattr(ray._private.worker.global_worker, "node", None)
    processes = [(kind, info.process) for kind, infos in
                 (getattr(node, "all_processes", None) or {}).items() for info in infos]
    deadline = time.monotonic() + wait_s
    while processes:
        for kind, process in processes:
            code = process.poll()
            if code is not None:
                how = (f"got {signal.Signals(-code).name}" if code < 0 else
                    f"exited with code {code}")
                return f"Ray's {kind} (pid {process.pid}) {how}"
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return None


@dataclass
class Reservation:
    """The run's placement group and, per plan node, its Ray node id and address."""
    pg: object
    node_ids: list[str]
    addresses: list[str]

    def options(self, proc: PlannedProcess) -> dict:
        """``.options(...)`` of ``proc``'s actor: its node's bundle and its share of it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        opts = {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=proc.node),
                "num_cpus": proc.num_cpus, "num_gpus": proc.num_gpus}
        if proc.role == "trainer" and proc.gpus:
            opts["runtime_env"] = {"env_vars": dict(NO_RAY_CUDA_VISIBLE)}
        return opts

    def release(self) -> None:
        ray.util.remove_placement_group(self.pg)


def reserve(plan: Plan, timeout_s: float = 600.0) -> Reservation:
    """Reserve every plan node's resources on its own Ray node (waits up to ``timeout_s``; a
    RuntimeError names what could not be placed)."""
    from ray.util.placement_group import placement_group, placement_group_table
    bundles = plan.node_resources()
    pg = placement_group(bundles, strategy="STRICT_SPREAD" if plan.nodes > 1 else "PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"cluster: the Ray cluster cannot hold the plan's {plan.nodes} "
                           f"node(s) (each on its own node): {bundles}; Ray has "
                           f"{ray.cluster_resources()} over {len(ray.nodes())} node(s)") from None
    table = placement_group_table(pg)["bundles_to_node_id"]
    node_ids = [table[i] for i in range(len(bundles))]
    by_id = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return Reservation(pg, node_ids, [by_id[i] for i in node_ids])
