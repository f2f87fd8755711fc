"""The policy's recent weight versions, for the asynchronous pipeline: samples generated from
weights up to ``rollout.max_staleness`` versions old are scored again by the trainer *at their
own version*, so the engine mismatch (same-version pairs) is told apart from the policy lag."""
from __future__ import annotations

import contextlib

import torch


def versioned_tensors(model) -> list[torch.Tensor]:
    """What a weight version consists of: the parameters and the routers' expert-bias buffers
    (they change with ``trainer.expert_bias_update_rate`` and are synced to the engines)."""
    return list(model.parameters()) + [b for n, b in model.named_buffers()
                                       if n.endswith("router.expert_bias")]


class WeightVersions:
    """Host copies of the last ``keep`` weight versions of ``model`` (this rank's shards)."""

    def __init__(self, model, keep: int):
        if keep < 1:
            raise ValueError(f"keep: expected >= 1, got {keep}")
        self.model, self.keep = model, keep
        self.saved: dict[int, list[torch.Tensor]] = {}

    def remember(self, version: int) -> None:
        """Copy the current weights as ``version``; forget versions older than the ``keep``
        before it (a sample of version v is at most ``keep`` versions old when scored)."""
        self.saved[version] = [t.detach().to("cpu", copy=True)
                               for t in versioned_tensors(self.model)]
        for old in [v for v in self.saved if v < version - self.keep]:
            del self.saved[old]

    def has(self, version: int) -> bool:
        return version in self.saved

    @contextlib.contextmanager
    @torch.no_grad()
    def weights_of(self, version: int):
        """Within this context the model holds the weights of ``version``; they are restored
        exactly afterwards."""
        tensors = versioned_tensors(self.model)
        current = [t.detach().clone() for t in tensors]
        for t, old in zip(tensors, self.saved[version]):
            t.copy_(old.to(t.device))
        try:
            yield
        finally:
            for t, now in zip(tensors, current):
                t.copy_(now)
