"""What the engine servers serve, on the rollout side (:class:`ServedWeights`): the weight
version, the last checkpoint they loaded from disk, the servers restarted since the last sync,
and how one restarted server is restored. The driver's :class:`moe_rl.orchestration.weight_sync.
WeightSync` reads it once per sync; nothing else on the rollout side tracks weights."""
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
