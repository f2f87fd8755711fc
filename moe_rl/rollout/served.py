"""What the engine servers serve, on the rollout side (:class:`ServedWeights`): the weight
version, the versions they reported at start, the last checkpoint they loaded from disk, the
servers restarted since the last sync, how one restarted server is restored, and the check
that they serve the version a batch is to be generated from. The driver's
:class:`moe_rl.orchestration.weight_sync.WeightSync` reads it once per sync; nothing else on
the rollout side tracks weights."""
from __future__ import annotations

from typing import Callable

# an export of the trainer for a restarted server: (version asked for) -> (checkpoint, version
# the trainer wrote: the one asked for where it still holds it, else its current one)
TrainerExport = Callable[[int], "tuple[str, int]"]


class ServedWeights:
    """The served weights' record. ``disk_only``: every sync loads a checkpoint from disk
    (``cluster.weight_sync: disk``); else the trainer's senders hand weights over in memory
    and a restarted server is restored from an export of the trainer (:attr:`trainer_export`,
    set once the trainers are connected)."""

    def __init__(self, disk_only: bool):
        self.disk_only = disk_only
        self.version = 0                   # what every server serves (0: the starting weights)
        self.checkpoint: str | None = None   # the last checkpoint loaded from disk
        self.restarted: list[str] = []     # servers restarted since the last sync
        self.trainer_export: TrainerExport | None = None
        self.started: set[str] = set()     # the versions the servers reported at start

    def record_start(self, versions: list[str]) -> None:
        """The versions the servers report before any sync (SGLang: "default"): they count as
        version 0."""
        self.started = set(versions)

    def check_serving(self, served: list[str], version: int, step: int) -> None:
        """Every server must report weight ``version`` (``served``: what each reports; before
        the first sync, a version a server started with counts as 0); else RuntimeError: a
        weight update that did not land where the loop expects it stops the run instead of
        training on samples of other weights."""
        fine = [v == str(version) or (version == 0 and v in self.started) for v in served]
        if not all(fine):
            raise RuntimeError(f"rollout: step {step}'s batch is to be generated from weight "
                               f"version {version}, but the engine servers report {served}")

    def loaded(self, checkpoint: str, version: int) -> None:
        """Every server loaded ``checkpoint`` as ``version``."""
        self.checkpoint, self.version = checkpoint, version

    def synced(self, version: int) -> None:
        """Every server took ``version`` in memory."""
        self.version = version

    def restore_point(self, url: str) -> tuple[str, int] | None:
        """The checkpoint the restarted server ``url`` loads and the version it is labelled
        with: the last disk load (disk sync); otherwise an export of the trainer asked for the
        served version, labelled with the version the trainer wrote (the asynchronous
        pipeline's trainer still holds the served version while it trains the next one). None
        before anything was loaded or connected: the server serves its starting weights, or
        the sync under way restores it. The server is counted as restarted either way."""
        self.restarted.append(url)
        if self.disk_only:
            return None if self.checkpoint is None else (self.checkpoint, self.version)
        if self.trainer_export is None:
            return None
        return self.trainer_export(self.version)

    def take_restarted(self) -> list[str]:
        """The servers restarted since the last call (the list is emptied)."""
        out, self.restarted = self.restarted, []
        return out
