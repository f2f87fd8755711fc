"""Trainer -> engine weight sync after every update, by ``cluster.weight_sync``:
a HF checkpoint on disk that every server loads (:class:`DiskSync`); or the trainer ranks' own
weight senders (:class:`InMemorySync`): a broadcast from trainer rank 0 over a process group the
servers joined (``distributed``: NCCL on GPUs, gloo on CPU), or CUDA tensors handed to colocated
SGLang servers (``tensor``); the sender is the engine's (``EngineKind.sender``).

Engine deaths: every sync starts with a health check that restarts a dead server (it comes back
with the current weights); a server restarted since the weight group was built makes the group be
rebuilt; a distributed or tensor sync that fails midway is redone from disk (the servers
restarted; the group is rebuilt at the next sync), so a sync never leaves a server on old weights."""
from __future__ import annotations

import os
import re

import ray

from moe_rl.config import Config
from moe_rl.errors import UserError
from moe_rl.owned_dirs import remove_owned


# what a full or read-only disk says (OSError 28, 30, 122), in the error or in the traceback a
# Ray task error carries
_DISK_FULL = re.compile(r".*(\[Errno (28|30|122)\]|No space left|Read-only file system|"
                        r"Disk quota exceeded).*")


class ExportError(UserError):
    """The weight export failed on its disk (no space left, read-only, over quota); nothing
    half-written is left."""


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
        """Export version ``version`` to ``weights/v{version}``; a failure on the disk removes
        what was written and is one line (ExportError); any other error is raised as it is."""
        target = os.path.join(self.weights_dir, f"v{version}")
        try:
            self.trainers.export(target)
        except Exception as exc:
            lines = [m.group(0).strip() for m in _DISK_FULL.finditer(str(exc))]
            if not lines:
                raise
            remove_owned(target)
            raise ExportError(f"exporting the weights of version {version} to {target} failed: "
                              f"{lines[-1][:300]}; the half-written export was removed; free "
                              f"space there and continue with --resume") from None
        return target

    def _sync_disk(self, version: int) -> None:
        ray.get(self.rollout.update_weights.remote(self._export(version), version))
        self._drop_older(version)

    def _drop_older(self, version: int) -> None:
        """Remove the earlier exports: folders this run's exports marked, nothing else."""
        for name in os.listdir(self.weights_dir):
            if name != f"v{version}":
                remove_owned(os.path.join(self.weights_dir, name))


class InMemorySync(DiskSync):
    """The in-memory modes (``distributed``, ``tensor``): the trainer ranks' own weight senders
    hand the tensors to the engines (one call to the trainers); a restarted server gets the
    trainer's weights exported for it; a failed sync is redone from disk and the transport
    reopened at the next."""

    def __init__(self, cfg: Config, plan, trainers, rollout, weights_dir: str):
        super().__init__(cfg, plan, trainers, rollout, weights_dir)
        self._reopen = False   # the transport is broken: a sync failed midway
        trainers.connect_engines(ray.get(rollout.urls.remote()), plan.tensor_sources)
        ray.get(rollout.set_weight_source.remote(trainers.actors, weights_dir))

    def sync(self, version: int, wait: bool = True) -> None:
        """As :meth:`DiskSync.sync`, always waiting: the in-memory transfers involve the
        trainer ranks and the engines together."""
        ray.get(self.rollout.health.remote())
        # a server restarted since the transport was opened is not in it
        reopen = ray.get(self.rollout.take_group_stale.remote()) or self._reopen
        if self.check is not None:   # the trainer holds this version's weights now
            self.check.record_trainer(version)
        try:
            opened = self.trainers.send_weights(version, reopen)["opened"]
            if opened is not None:
                print(opened, flush=True)
            self._reopen = False
            ray.get(self.rollout.set_version.remote(version))
        except Exception as exc:   # a server died midway: redo this version from disk
            self.recoveries += 1
            self._reopen = True
            print(f"weight sync ({self.cfg.cluster.weight_sync}) of version {version} failed "
                  f"({exc}); restarting the servers that died and syncing from disk", flush=True)
            ray.get(self.rollout.health.remote())
            self.trainers.abort_weight_update()
            self._sync_disk(version)
        self.verify(version)

    def _redo_from_disk(self, version: int) -> None:
        """Export this version (the trainer still holds it: in-memory syncs are awaited) and
        load it from disk."""
        self._sync_disk(version)


def weight_sync_for(cfg: Config, plan, trainers, rollout, weights_dir: str) -> DiskSync:
    """The weight sync of ``cluster.weight_sync`` between the processes of ``plan``."""
    sync = DiskSync if cfg.cluster.weight_sync == "disk" else InMemorySync
    return sync(cfg, plan, trainers, rollout, weights_dir)
