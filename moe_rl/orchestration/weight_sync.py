"""Trainer -> engine weight sync after every update (:class:`WeightSync`), by
``cluster.weight_sync``, through one of two transports: a HF checkpoint on disk that every server
loads (:class:`DiskExport`); or the trainer ranks' own weight senders (:class:`TrainerSenders`):
a broadcast from trainer rank 0 over a process group the servers joined (``distributed``: NCCL on
GPUs, gloo on CPU), or CUDA tensors handed to colocated SGLang servers (``tensor``); the sender
is the engine's (``EngineKind.sender``).

The driver's side holds the weight state (the version the engines should serve, whether the
transport must be reopened, the recoveries, the weight check); the rollout side keeps the record
of what is served (:class:`moe_rl.rollout.served.ServedWeights`), read once per sync.

Engine deaths: every sync starts with that read, whose health check restarts a dead server (it
comes back with the served weights); a server restarted since the last sync makes the transport
be reopened before sending; an in-memory sync that fails midway is redone from disk (the servers
restarted; the transport reopened at the next sync), so a sync never leaves a server on old
weights."""
from __future__ import annotations

import os
import re

import ray

from moe_rl.config import Config
from moe_rl.errors import UserError
from moe_rl.owned_dirs import remove_owned


# what a full or read-only disk says (OSError 28, 30, 122), in the error or in the traceback a
# Ray task error carries
_DISK_FULL = re.compile(r".*(\[Errno (1|13|28|30|122)\]|No space left|Read-only file system|"
                        r"Disk quota exceeded|Permission denied|Operation not permitted).*")


class ExportError(UserError):
    """The weight export failed on its disk (no space left, read-only, over quota, not
    permitted); nothing half-written is left."""


class DiskExport:
    """The disk transport: the trainer's HF checkpoint in ``weights/v{version}``, which every
    server loads (queued on the rollout worker, behind any batch it is still generating).
    Also every transport's fallback."""

    in_memory = False

    def __init__(self, trainers, rollout, weights_dir: str):
        self.trainers, self.rollout, self.weights_dir = trainers, rollout, weights_dir

    def path(self, version: int) -> str:
        return os.path.join(self.weights_dir, f"v{version}")

    def export(self, version: int) -> str:
        """Export version ``version``; a failure on the disk removes what was written and is
        one line (ExportError); any other error is raised as it is."""
        target = self.path(version)
        try:
            self.trainers.export(target)
        except Exception as exc:
            lines = [m.group(0).strip() for m in _DISK_FULL.finditer(str(exc))]
            if not lines:
                raise
            remove_owned(target)
            raise ExportError(f"exporting the weights of version {version} to {target} failed: "
                              f"{lines[-1][:300]}; the half-written export was removed; free "
                              f"space there (or make it writable) and continue with --resume"
                              ) from None
        return target

    def load(self, path: str, version: int):
        """Queue the load of ``path`` as ``version`` on every server; the call's reference."""
        return self.rollout.update_weights.remote(path, version)

    def send(self, version: int, reopen: bool) -> list:
        """Export and queue the load (``reopen``: nothing to reopen on disk)."""
        return [self.load(self.export(version), version)]

    def drop_older(self, version: int) -> None:
        """Remove the earlier exports: folders this run's exports marked, nothing else (none
        before the first export)."""
        if not os.path.isdir(self.weights_dir):
            return
        for name in os.listdir(self.weights_dir):
            if name != f"v{version}":
                remove_owned(os.path.join(self.weights_dir, name))


class TrainerSenders:
    """The in-memory transports (``distributed``, ``tensor``): the trainer ranks' own weight
    senders hand the tensors to the engines (one call to the trainers, awaited)."""

    in_memory = True

    def __init__(self, plan, trainers, rollout, weights_dir: str):
        self.trainers, self.rollout = trainers, rollout
        trainers.connect_engines(ray.get(rollout.urls.remote()), plan.tensor_sources)
        # a server restarted outside a sync is restored from an export of the trainer
        ray.get(rollout.set_weight_source.remote(trainers.actors, weights_dir))

    def send(self, version: int, reopen: bool) -> list:
        """Send ``version`` (the transport rebuilt first when ``reopen``); the record's update."""
        opened = self.trainers.send_weights(version, reopen)["opened"]
        if opened is not None:
            print(opened, flush=True)
        return [self.rollout.mark_served.remote(version)]

    def abort(self) -> None:
        """After a failed send: close whatever the servers still have open."""
        self.trainers.abort_weight_update()


class WeightSync:
    """Brings every engine server to the trainer's weights after each update, and alone holds
    the driver's weight state: whether the transport must be reopened, :attr:`recoveries` and
    the weight check (:attr:`check`, ``rollout.weight_check``); what the engines serve is the
    rollout side's record (:class:`moe_rl.rollout.served.ServedWeights`)."""

    def __init__(self, cfg: Config, plan, trainers, rollout, weights_dir: str):
        self.cfg, self.rollout = cfg, rollout
        self.disk = DiskExport(trainers, rollout, weights_dir)
        self.transport = (self.disk if cfg.cluster.weight_sync == "disk"
                          else TrainerSenders(plan, trainers, rollout, weights_dir))
        self.reopen = False   # the transport is broken: a sync failed midway
        self.recoveries = 0
        self.check = None     # the WeightCheck, once the run has one
        self._pending: tuple | None = None   # a sync handed over, unconfirmed

    def sync(self, version: int, wait: bool = True) -> None:
        """Bring every server to the trainer's current weights as ``version``: read the
        rollout side (the health check first restarts a dead server), reopen the transport for
        servers restarted since the last sync, send. On disk the read and the load are queued
        behind any batch still being generated; ``wait`` False (the asynchronous pipeline)
        returns once they are queued and :meth:`wait` (the next sync, the run's end) confirms
        them. In-memory sends involve the trainer ranks and the engines together: awaited."""
        self.wait()
        read = [self.rollout.served_state.remote()]
        if self.transport.in_memory:   # read before sending
            self._reopen_for(ray.get(read.pop()), version)
        if self.check is not None:   # the trainer holds this version's weights now
            self.check.record_trainer(version)
        try:
            refs = self.transport.send(version, self.reopen)
            self.reopen = False
        except Exception as exc:
            if not self.transport.in_memory:
                raise
            refs = self._recover(version, exc)
        self._pending = (read + refs, version)
        if wait or self.transport.in_memory:
            self.wait()

    def _reopen_for(self, state: dict, version: int) -> None:
        """Mark the transport to be reopened when servers restarted since the last sync (they
        are not in it)."""
        if state["restarted"]:
            self.reopen = True
            print(f"weight sync of version {version}: {len(state['restarted'])} server(s) "
                  f"restarted since the last sync ({', '.join(state['restarted'])}; the "
                  f"servers report versions {state['versions']}); reopening the "
                  f"{self.cfg.cluster.weight_sync} transport", flush=True)

    def _recover(self, version: int, exc: Exception) -> list:
        """A send failed midway (a server died): restart the dead servers, close the
        transport, load this version from disk; the transport is reopened at the next sync."""
        self.recoveries += 1
        self.reopen = True
        print(f"weight sync ({self.cfg.cluster.weight_sync}) of version {version} failed "
              f"({exc}); restarting the servers that died and syncing from disk", flush=True)
        ray.get(self.rollout.served_state.remote())
        self.transport.abort()
        return [self.disk.load(self.disk.export(version), version)]

    def wait(self) -> None:
        """Confirm the last sync (raises what it raised), check it, drop the older exports."""
        if self._pending is None:
            return
        refs, version = self._pending
        self._pending = None
        ray.get(refs)
        self.verify(version)
        self.disk.drop_older(version)

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
        """Load ``version`` again from disk: its export (still there: the disk transport's
        trainer may have moved on since, with the asynchronous pipeline), or one made now (an
        in-memory sync is awaited: the trainer still holds it)."""
        path = (self.disk.export(version) if self.transport.in_memory
                else self.disk.path(version))
        ray.get(self.disk.load(path, version))
