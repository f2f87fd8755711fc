"""The engine self-check after every weight update (``rollout.weight_check``): a weight sync can
leave an engine serving wrong weights without any error (a quantised expert written wrong, a
bucket applied to the wrong tensor), and a run would train for days on samples from a policy it
is not updating. After each sync, a fixed probe (a few responses, :meth:`RolloutWorker.make_probe`)
is scored by every engine server and by the trainer at the same weight version, and compared:

- ``weights/probe_k3``: mean over the probe's tokens and servers of ``exp(d) - d - 1``,
  ``d = lp_trainer - lp_engine``;
- ``weights/probe_max_abs_diff``: the largest ``|d|``;
- ``weights/probe_routing_agreement``: the share of (token, MoE layer) expert choices on which
  each server's routers and the trainer's agree (with routing returned by the engine).

The probe's k3 at the run's start is what the engine's precision explains (bfloat16, FP8); the
check fires past ``max(rollout.weight_check.factor x that, rollout.weight_check.floor)``.
Then the sync is redone from disk once (``weights/check_resyncs``); still past the limit, the
run stops naming the version, the engine and the figures."""
from __future__ import annotations

import math
import time

import ray
import torch

from moe_rl.config.schema import WeightCheckConfig
from moe_rl.orchestration.failures import RunFailed
from moe_rl.rollout_record import RolloutBatch


class WeightCheck:
    """The probe and its figures; the weight sync calls :meth:`record_trainer` when the trainer
    holds a version's weights and :meth:`passes` once the engines load them. ``sync`` and
    ``engine`` name the weight sync and the engine in the stop's line."""

    def __init__(self, settings: WeightCheckConfig, trainers, rollout, sync: str, engine: str):
        self.settings, self.trainers, self.rollout = settings, trainers, rollout
        self.sync, self.engine = sync, engine
        self.trainer_side: dict[int, list] = {}
        self.baseline: float | None = None
        self.resyncs = 0
        self.seconds = 0.0   # the last version's check, both sides
        self.metrics: dict[str, float] = {}
        self.probe = ray.put(ray.get(rollout.make_probe.remote()))   # fixed for the run

    @property
    def limit(self) -> float:
        return max(self.settings.factor * (self.baseline or 0.0), self.settings.floor)

    def record_trainer(self, version: int) -> None:
        """The trainer's side of ``version``'s check, taken while it holds those weights."""
        t0 = time.perf_counter()
        self.trainer_side = {version: self.trainers.probe(self.probe)}
        self.seconds = time.perf_counter() - t0

    def passes(self, version: int) -> bool:
        """Score the probe on the engines now (serving ``version``) and compare with the
        trainer's side of that version; the first check sets the baseline. Whether the probe
        is within the limit (:attr:`metrics` hold the figures)."""
        if version not in self.trainer_side:
            raise RuntimeError(f"weight check: no trainer side recorded for version {version}")
        t0 = time.perf_counter()
        engine = RolloutBatch.from_bytes(ray.get(self.rollout.score_probe.remote())).samples
        self.metrics = probe_figures(engine, self.trainer_side[version])
        self.seconds += time.perf_counter() - t0
        self.metrics["timing/weight_check_s"] = self.seconds
        if self.baseline is None:
            self.baseline = self.metrics["weights/probe_k3"]
        self.metrics["weights/check_resyncs"] = float(self.resyncs)
        return self.metrics["weights/probe_k3"] <= self.limit

    def failure(self, version: int) -> RunFailed:
        """The stop when the probe stays past the limit after a sync redone from disk."""
        m = self.metrics
        agree = m.get("weights/probe_routing_agreement")
        return RunFailed(
            f"weight check: after syncing version {version} ({self.sync}) and "
            f"again after reloading it from disk, the engine ({self.engine}) "
            f"disagrees with the trainer on the probe: k3 {m['weights/probe_k3']:.3g} (limit "
            f"{self.limit:.3g}: {self.settings.factor:g} x the start's "
            f"{self.baseline:.3g}, at least rollout.weight_check.floor="
            f"{self.settings.floor:g}), max |log-prob difference| "
            f"{m['weights/probe_max_abs_diff']:.3g}"
            + (f", routing agreement {agree:.4f}" if agree is not None else "")
            + "; the engine's weights are wrong: the run stops rather than train on them")


def probe_figures(engine: list, trainer: list) -> dict[str, float]:
    """The check's figures from the engine's scored probe (``pass_logprobs`` [servers, R] and
    routing per sample) and the trainer's side ((log-probs, routing) per sample)."""
    k3_sum, n, worst, agree, choices = 0.0, 0, 0.0, 0.0, 0
    for s, (lp_trainer, routing) in zip(engine, trainer):
        d = (torch.tensor(lp_trainer, dtype=torch.float64)[None] -
            s.pass_logprobs.to(torch.float64))
        d = d[:, s.loss_mask.to(torch.bool)]
        k3_sum += float((torch.exp(d.clamp(-20, 20)) - d - 1).sum())
        n += d.numel()
        worst = max(worst, float(d.abs().max())) if d.numel() else worst
        if routing is not None and s.routing is not None:
            ours, theirs = torch.tensor(routing).long(), s.routing.long()
            both = (ours[..., :, None] == theirs[..., None, :]).any(-1)   # [P, L, K]
            agree += float(both.sum())
            choices += both.numel()
    out = {"weights/probe_k3": k3_sum / max(n, 1), "weights/probe_max_abs_diff": worst}
    if choices:
        out["weights/probe_routing_agreement"] = agree / choices
    if not math.isfinite(out["weights/probe_k3"]):
        out["weights/probe_k3"] = math.inf
    return out
