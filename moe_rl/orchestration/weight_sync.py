"""Trainer -> engine weight sync after every update, one class per ``cluster.weight_sync`` mode:
a HF checkpoint on disk that every server loads (:class:`DiskSync`); a broadcast from trainer
rank 0 over a process group the servers joined (:class:`DistributedSync`: NCCL on GPUs, gloo on
CPU); CUDA tensors handed to colocated SGLang servers (:class:`TensorSync`).

Engine deaths: every sync starts with a health check that restarts a dead server (it comes back
with the current weights); a server restarted since the weight group was built makes the group be
rebuilt; a distributed or tensor sync that fails midway is redone from disk (the servers
restarted, the group rebuilt), so a sync never leaves a server on old weights."""
from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod

import ray

from moe_rl.config import Config
from moe_rl.engines.factory import weight_ranks_per_server


class DiskSync:
    """Export a HF checkpoint (``weights/v{version}``) that every server loads; the pool
    restarts and retries a server that dies meanwhile."""

    def __init__(self, cfg: Config, plan, trainers, rollout, weights_dir: str):
        self.cfg, self.plan, self.trainers, self.rollout = cfg, plan, trainers, rollout
        self.weights_dir = weights_dir
        self.recoveries = 0
        self._loading: tuple | None = None   # a load handed to the rollout worker, unconfirmed
        self.check = None   # the WeightCheck (rollout.weight_check), once the run has one

    def sync(self, version: int, wait: bool = True) -> None:
        """Bring every engine server to the trainer's current weights as ``version``. The
        export comes first; the health check (a dead server is restarted first) and the load
        are queued on the rollout worker, behind any batch it is still generating. ``wait``
        False (the asynchronous pipeline) returns once they are queued: the batches launched
        afterwards run after the load, and :meth:`wait` (called by the next sync and at the
        end) confirms it and raises its error."""
        self.wait()
        target = self._export(version)
        if self.check is not None:   # the trainer holds this version's weights now
            self.check.record_trainer(version)
        self._loading = (self.rollout.health.remote(),
                         self.rollout.update_weights.remote(target, version), version)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Confirm the last load (raises what it raised); then drop the older exports."""
        if self._loading is None:
            return
        health, load, version = self._loading
        self._loading = None
        ray.get(health)
        ray.get(load)
        self.verify(version)
        self._drop_older(version)

    def verify(self, version: int) -> None:
        """The weight check of ``version`` (when on): past its limit the sync is redone from
        disk once, then checked again; still past it, the run stops (RunFailed)."""
        if self.check is None or self.check.passes(version):
            return
        self.check.resyncs += 1
        print(f"weight check: the engines disagree with the trainer after syncing version "
              f"{version} (probe k3 {self.check.metrics['weights/probe_k3']:.3g}, limit "
              f"{self.check.limit:.3g}); reloading it from disk", flush=True)
        self._redo_from_disk(version)
        if not self.check.passes(version):
            raise self.check.failure(version)

    def _redo_from_disk(self, version: int) -> None:
        """Load ``version`` again from its export (still on disk: the trainer may have moved
        on since, with the asynchronous pipeline)."""
        ray.get(self.rollout.update_weights.remote(
            os.path.join(self.weights_dir, f"v{version}"), version))

    def _export(self, version: int) -> str:
        target = os.path.join(self.weights_dir, f"v{version}")
        self.trainers.export(target)
        return target

    def _sync_disk(self, version: int) -> None:
        ray.get(self.rollout.update_weights.remote(self._export(version), version))
        self._drop_older(version)

    def _drop_older(self, version: int) -> None:
        for name in os.listdir(self.weights_dir):
            if name != f"v{version}":
                shutil.rmtree(os.path.join(self.weights_dir, name), ignore_errors=True)


class _InMemorySync(DiskSync, ABC):
    """Shared by the in-memory modes: the trainer ranks send to the engines' weight receiver
    themselves; a restarted server gets the trainer's weights exported for it; a failed sync is
    redone from disk."""

    def __init__(self, cfg: Config, plan, trainers, rollout, weights_dir: str):
        super().__init__(cfg, plan, trainers, rollout, weights_dir)
        urls = ray.get(rollout.urls.remote())
        ray.get([a.connect_engines.remote(urls) for a in trainers.actors])
        ray.get(rollout.set_weight_source.remote(trainers.actors, weights_dir))

    def sync(self, version: int, wait: bool = True) -> None:
        """As :meth:`DiskSync.sync`, always waiting: the in-memory transfers involve the
        trainer ranks and the engines together."""
        ray.get(self.rollout.health.remote())
        self._prepare()
        if self.check is not None:   # the trainer holds this version's weights now
            self.check.record_trainer(version)
        try:
            self._send(version)
        except Exception as exc:   # a server died midway: redo this version from disk
            self.recoveries += 1
            print(f"weight sync ({self.cfg.cluster.weight_sync}) of version {version} failed "
                  f"({exc}); restarting the servers that died and syncing from disk", flush=True)
            ray.get(self.rollout.health.remote())
            ray.get(self.trainers.actors[0].abort_weight_update.remote())
            self._sync_disk(version)
            self._after_recovery()
        self.verify(version)

    def _redo_from_disk(self, version: int) -> None:
        """Export this version (the trainer still holds it: in-memory syncs are awaited) and
        load it from disk."""
        self._sync_disk(version)

    def _prepare(self) -> None:
        """Before a sync (nothing by default)."""

    def _after_recovery(self) -> None:
        """After a sync redone from disk (nothing by default)."""

    @abstractmethod
    def _send(self, version: int) -> None:
        """Hand ``version`` to every server."""


def group_address(single_node: bool, node_address) -> str:
    """The weight-update group's master address: 127.0.0.1 on a one-node run (a one-node run
    never uses the node's other addresses), else ``node_address()``, trainer rank 0's."""
    return "127.0.0.1" if single_node else node_address()


class DistributedSync(_InMemorySync):
    """Broadcast the HF-named tensors from trainer rank 0 over a process group with every
    server's ranks, inside a weight-update session; the group is rebuilt after any restart."""

    def __init__(self, cfg: Config, plan, trainers, rollout, weights_dir: str):
        super().__init__(cfg, plan, trainers, rollout, weights_dir)
        self.group_name: str | None = None
        self.groups_built = 0
        self._open_group()

    def _open_group(self) -> None:
        """(Re)build the weight-update group: trainer rank 0 and every server's ranks."""
        r = self.cfg.rollout
        world = 1 + r.num_servers * weight_ranks_per_server(self.cfg)
        backend = "nccl" if self.cfg.cluster.gpus_per_node > 0 else "gloo"
        rank0 = self.trainers.actors[0]
        # one node: the servers are local, the group stays on loopback; else rank 0's address
        address = group_address(self.trainers.single_node,
                                lambda: ray.get(rank0.node_ip.remote()))
        port = ray.get(rank0.free_port.remote(address))   # free on the node that binds it
        previous, self.group_name = self.group_name, f"moe_rl_weights_{self.groups_built}"
        self.groups_built += 1
        print(f"weight-update group {self.group_name}: {backend} at {address}:{port}, "
              f"{world} ranks", flush=True)
        ray.get(rank0.open_weight_group.remote(backend, address, port, world, self.group_name,
                                               r.request_timeout_s, previous))
        ray.get(self.rollout.take_group_stale.remote())   # the group is fresh

    def _prepare(self) -> None:
        if ray.get(self.rollout.take_group_stale.remote()):
            self._open_group()

    def _after_recovery(self) -> None:
        self._open_group()

    def _send(self, version: int) -> None:
        ray.get([a.stream_weights_distributed.remote(version) for a in self.trainers.actors])
        ray.get(self.rollout.set_version.remote(version))


class TensorSync(_InMemorySync):
    """Colocated SGLang: the trainer rank on each SGLang TP rank's GPU (the plan's
    ``tensor_sources``) hands it the tensors (``/update_weights_from_tensor``)."""

    def _send(self, version: int) -> None:
        sources = self.plan.tensor_sources   # which trainer rank feeds which TP rank
        ray.get([a.push_weights_tensor.remote(sources, version) for a in self.trainers.actors])
        ray.get(self.rollout.set_version.remote(version))


SYNC_MODES = {"disk": DiskSync, "distributed": DistributedSync, "tensor": TensorSync}


def weight_sync_for(cfg: Config, plan, trainers, rollout, weights_dir: str) -> DiskSync:
    """The weight sync of ``cluster.weight_sync`` between the processes of ``plan``."""
    return SYNC_MODES[cfg.cluster.weight_sync](cfg, plan, trainers, rollout, weights_dir)
